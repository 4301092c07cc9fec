"""Checks for 05_sampling: temperature by hand, top-k by hand, and a Monte-Carlo estimate within tolerance."""
from __future__ import annotations

import math

import torch

from ..sampling import SamplingConfig, logits_to_probs, top_k_filter
from . import safely, verdict


def _test_logits(logits: torch.Tensor) -> list[torch.Tensor]:
    """The learner's function is tried on the real logits and on two small hand-made vectors."""
    return [logits.float(), torch.tensor([2.0, 1.0, 0.5, -1.0]), torch.tensor([0.0, 0.0, 3.0, 1.0, 1.0])]


def check_temperature_probs(temperature_probs, logits) -> bool:
    """temperature_probs(logits, T) -> softmax(logits / T), for T > 0."""
    for vec in _test_logits(logits):
        for t in (0.5, 1.0, 1.7):
            ok, got = safely(temperature_probs, vec.clone(), t)
            if not ok:
                return verdict(False, "", got)
            want = logits_to_probs(vec, SamplingConfig(temperature=t))
            if not torch.is_tensor(got) or got.shape != want.shape or not torch.allclose(got.float(), want, atol=1e-6):
                return verdict(False, "", f"at T={t} your probabilities differ. Hint: torch.softmax(logits / T, dim=-1)")
    return verdict(True, "dividing by T before the softmax is all temperature does", "")


def check_top_k(my_top_k, logits) -> bool:
    """my_top_k(logits, k) -> logits with all but the k largest set to -inf."""
    for vec in _test_logits(logits):
        for k in (1, 2, 3):
            ok, got = safely(my_top_k, vec.clone(), k)
            if not ok:
                return verdict(False, "", got)
            want = top_k_filter(vec, k)
            if not torch.is_tensor(got) or got.shape != want.shape or not torch.equal(got.float(), want):
                return verdict(False, "", f"for k={k} your result differs. Hint: torch.topk(logits, k).values[-1] is the "
                               "k-th largest; masked_fill everything below it with float('-inf')")
    return verdict(True, "your top-k matches course_lib's (and transformers') filter", "")


def check_estimate(estimate, token_id: int, logits, draws: int = 5000) -> bool:
    """estimate: the share of `draws` samples at temperature 1 that were token_id. Accepts 4 standard errors."""
    if not isinstance(estimate, (int, float)) or not 0 <= estimate <= 1:
        return verdict(False, "", "give a probability between 0 and 1")
    p = float(torch.softmax(logits.float(), dim=-1)[token_id])
    tolerance = 4 * math.sqrt(p * (1 - p) / draws)
    ok = abs(estimate - p) <= tolerance
    return verdict(ok, f"your estimate {estimate:.4f} is within {tolerance:.4f} of the exact {p:.4f}",
                   f"{estimate:.4f} is too far from the model's probability (tolerance {tolerance:.4f}). "
                   f"Did you draw {draws} samples at temperature 1 and divide the count by {draws}?")
