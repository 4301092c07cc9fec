import math

import torch

from course_lib.runner.attention import attention_weights

model = tokenizer = None  # lesson 04 loads the model with attn_implementation="eager"


def causal_mask(T):
    return torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)


def head_weights(q, k):
    T, D = q.shape
    scores = (q @ k.T / math.sqrt(D)).masked_fill(causal_mask(T), float("-inf"))
    return torch.softmax(scores, dim=-1)


def kv_head_of(query_head):
    return query_head // (model.config.num_attention_heads // model.config.num_key_value_heads)


def strongest(text, query, key):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    pieces = [tokenizer.decode([i]) for i in ids]
    scores = attention_weights(model, ids)[:, :, pieces.index(query), pieces.index(key)]  # (L, H)
    flat = int(scores.argmax())
    return flat // scores.shape[1], flat % scores.shape[1]


# Section 8 (causal probes)
patch_prediction = 1.0


def most_important_head(effects):
    flat = int(effects.argmin())
    return flat // effects.shape[1], flat % effects.shape[1]


def layer_effect(layer):
    from course_lib.inside import probes
    ids = probes.answer_ids(tokenizer, "What is the capital of France?", "The capital of France is")
    good, bad = probes.token_id(tokenizer, " Paris"), probes.token_id(tokenizer, " Berlin")
    reference = [probes.answer_ids(tokenizer, f"What is the capital of {c}?", f"The capital of {c} is")
                 for c in ["Italy", "Spain", "Japan", "Egypt", "Canada", "Brazil"]]
    means = probes.mean_head_outputs(model, reference)
    heads = [(layer, h) for h in range(model.config.num_attention_heads)]
    return probes.ablated_metric(model, ids, good, bad, heads, means) - probes.ablated_metric(model, ids, good, bad, [])
