"""Checks for 11_model_from_scratch: RMSNorm by hand, rotary for one vector, and the cache's bytes predicted."""
from __future__ import annotations

import torch

from ..runner.attention import apply_rotary, rotary_cos_sin
from ..runner.model import norm
from . import safely, verdict


def check_rms_norm(rms_norm, ours) -> bool:
    """rms_norm(x, weight, eps) -> x scaled to unit root-mean-square along the last axis, times weight."""
    x = ours.embedding[[504, 3575, 42, 9]] * 7.0  # (4, hidden): real embedding rows, scaled
    weight, eps = ours.layers[0].attn_norm, ours.eps
    ok, got = safely(rms_norm, x, weight, eps)
    if not ok:
        return verdict(False, "", got)
    want = norm(x, weight, eps)
    if not torch.is_tensor(got) or got.shape != want.shape or not torch.allclose(got, want, atol=1e-5):
        return verdict(False, "", "your result differs from the model's norm. Hint: divide by sqrt(mean(x**2) + eps) "
                       "over the LAST axis (keepdim=True), then multiply by weight; no mean is subtracted")
    return verdict(True, "your RMSNorm equals the one the model uses on its real weights", "")


def check_rotate(rotate, ours) -> bool:
    """rotate(x, position) -> the (D,) vector x turned by rotary at that position (llama pairs i with i + D/2)."""
    D, theta = ours.head_dim, ours.config.rope_parameters["rope_theta"]
    x = torch.linspace(-1, 1, D)
    for position in [0, 1, 7, 1000]:
        ok, got = safely(rotate, x.clone(), position)
        if not ok:
            return verdict(False, "", got)
        cos, sin = rotary_cos_sin(torch.tensor([position]), D, theta)
        want = apply_rotary(x[None], cos, sin)[0]
        if not torch.is_tensor(got) or got.shape != want.shape or not torch.allclose(got, want, atol=1e-4):
            return verdict(False, "", f"at position {position} your vector differs. Hint: angle_i = position / "
                           f"theta ** (2i / D) for i < D/2, used for both dimension i and i + D/2; "
                           "out = x * cos + cat(-x[D/2:], x[:D/2]) * sin")
    return verdict(True, "position 0 leaves the vector alone; every later position turns each pair by its own angle", "")


def check_cache_bytes(predict, ours) -> bool:
    """predict(batch, tokens) -> bytes of ours.new_cache(batch, tokens), worked out from the config."""
    for batch, tokens in [(1, 1), (1, 4000), (3, 100)]:
        ok, got = safely(predict, batch, tokens)
        if not ok:
            return verdict(False, "", got)
        want = ours.new_cache(batch, tokens).nbytes()
        if got != want:
            return verdict(False, "", f"for batch {batch}, {tokens} tokens you said {got!r}; the cache holds {want:,} "
                           "bytes. Hint: 2 (keys, values) x layers x KV heads x head dim x bytes per number x tokens x batch")
    return verdict(True, "you predicted the preallocated cache's bytes before reading them", "")
