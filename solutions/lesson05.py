import torch

from course_lib.engine.sampling import logits_to_probs, sample

model = tokenizer = None


def temperature_probs(logits, T):
    return torch.softmax(logits / T, dim=-1)


def my_top_k(logits, k):
    kth_largest = torch.topk(logits, k).values[-1]
    return logits.masked_fill(logits < kth_largest, float("-inf"))


def draws(logits, n=5000, seed=0):
    probs = logits_to_probs(logits)
    return sample(probs, torch.Generator(device=probs.device).manual_seed(seed), n).tolist()


def nucleus_prediction(logits, temperature=1.5, top_p=0.9):
    """Counted rather than guessed: what a learner who tries a few temperatures with reshape() would write."""
    from course_lib.engine.sampling import SamplingConfig, reshape
    return reshape(logits, SamplingConfig(temperature=temperature, top_p=top_p)).kept
