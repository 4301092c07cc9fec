import math

import torch

from course_lib.attention import attention_weights

model = tokenizer = None  # lesson 04 loads the model with attn_implementation="eager"


def causal_mask(T):
    return torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)


def head_weights(q, k):
    T, D = q.shape
    scores = (q @ k.T / math.sqrt(D)).masked_fill(causal_mask(T), float("-inf"))
    return torch.softmax(scores, dim=-1)


def kv_head_of(query_head):
    return query_head // (model.config.num_attention_heads // model.config.num_key_value_heads)


def strongest():
    ids = tokenizer("The bank is closed because they had no money left.", add_special_tokens=False)["input_ids"]
    pieces = [tokenizer.decode([i]) for i in ids]
    scores = attention_weights(model, ids)[:, :, pieces.index(" they"), pieces.index(" bank")]  # (L, H)
    flat = int(scores.argmax())
    return flat // scores.shape[1], flat % scores.shape[1]
