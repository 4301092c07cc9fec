import torch

from course_lib.inside.anatomy import logit_lens

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


def pass_prediction(ids, n=64):
    """From section 7's two timings: a straight line between the 1-token pass and the many-token pass."""
    from course_lib.runner.forward import forward_logits
    from course_lib.runtime import time_it
    many = list(ids) * 8
    one_s = time_it(lambda: forward_logits(model, list(ids[:1])), model.device, repeats=3).best
    many_s = time_it(lambda: forward_logits(model, many), model.device, repeats=3).best
    return 1000 * (one_s + (many_s - one_s) * (n - 1) / (len(many) - 1))
