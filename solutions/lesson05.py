import torch

from course_lib.sampling import logits_to_probs, sample

model = tokenizer = None


def temperature_probs(logits, T):
    return torch.softmax(logits / T, dim=-1)


def my_top_k(logits, k):
    kth_largest = torch.topk(logits, k).values[-1]
    return logits.masked_fill(logits < kth_largest, float("-inf"))


def estimate(logits, the_id, draws=5000, seed=0):
    probs = logits_to_probs(logits)
    tokens = sample(probs, torch.Generator(device=probs.device).manual_seed(seed), draws)
    return float((tokens == the_id).float().mean())
