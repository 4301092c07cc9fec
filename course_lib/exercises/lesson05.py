"""Checks for 05_sampling: temperature by hand, top-k by hand, and a Monte-Carlo estimate within tolerance, and
the size of top-p's nucleus at a higher temperature predicted before it is counted."""
from __future__ import annotations

import math

import torch

from ..engine.sampling import SamplingConfig, logits_to_probs, reshape, top_k_filter
from . import check_prediction, safely, verdict


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


def check_estimate(draws, token_id: int, logits, n: int = 5000) -> bool:
    """draws: the n token IDs you sampled at temperature 1 (a list or a tensor). The check computes the share equal
    to token_id and accepts it within 4 standard errors of the model's probability; the draws must also spread over
    the five likeliest tokens as samples do (so a made-up list, or one number, does not pass)."""
    if torch.is_tensor(draws):
        draws = draws.flatten().tolist()
    if not isinstance(draws, (list, tuple)) or len(draws) != n or not all(isinstance(t, int) for t in draws):
        return verdict(False, "", f"give the {n} sampled token IDs themselves (a list of ints, or the tensor sample() "
                       "returned), not the estimate")
    probs = torch.softmax(logits.float(), dim=-1)  # (V,)
    if not all(0 <= t < probs.numel() for t in draws):
        return verdict(False, "", "some of your IDs are not in the vocabulary")
    counts = torch.bincount(torch.tensor(draws), minlength=probs.numel()).float()
    top = torch.topk(probs, 5).indices
    for t in [token_id] + [int(i) for i in top]:
        p, share = float(probs[t]), float(counts[t]) / n
        if abs(share - p) > 4 * math.sqrt(p * (1 - p) / n) + 1e-9:
            return verdict(False, "", f"token {t} makes {share:.4f} of your draws, too far from what {n} draws at "
                           "temperature 1 give. Did you sample from softmax(logits) with sample(probs, generator, n)?")
    estimate = float(counts[token_id]) / n
    return verdict(True, f"your draws estimate {estimate:.4f} for the token, within four standard errors of the "
                   f"model's exact {float(probs[token_id]):.4f}", "")


def check_nucleus_prediction(prediction, logits, temperature: float = 1.5, top_p: float = 0.9,
                             tolerance: float = 2.0) -> bool:
    """prediction: your prediction, written BEFORE this runs, of how many tokens top-p keeps at `temperature` on
    these logits (the cell before printed what it keeps at temperature 1). Counted on the model's real logits."""
    config = SamplingConfig(temperature=temperature, top_p=top_p)
    return check_prediction(prediction, lambda: reshape(logits, config).kept, unit="tokens",
                            what=f"kept by top-p {top_p} at temperature {temperature}", tolerance=tolerance,
                            hint="The tail holds tens of thousands of tokens, each tiny; flattening moves mass into "
                                 "all of them at once, and the nucleus must take many to reach its share")
