import torch

from course_lib.anatomy import logit_lens

model = tokenizer = None


def count_params(module):
    return sum(p.numel() for p in module.parameters())


def entropy_bits(probs):
    p = probs[probs > 0]
    return float(-(p * p.log2()).sum())


def first_layer(text, word):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    top, _ = logit_lens(model, ids)  # (L+1, T, 1)
    target = tokenizer(word, add_special_tokens=False)["input_ids"][0]
    return next(row - 1 for row in range(1, top.shape[0]) if int(top[row, -1, 0]) == target)


def project(hidden):
    with torch.inference_mode():
        return int(model.lm_head(model.model.norm(hidden)).argmax())
