"""Checks for 12_bytes_per_token: predict speed from bytes, quantize a matrix to int8, and one 4-bit block."""
from __future__ import annotations

import torch

from ..runner.formats import quantize_int4, quantize_int8
from . import safely, verdict


def check_predict(predict, bytes_per_token: float, read_bytes_per_s: float, measured_tokens_per_s: float) -> bool:
    """predict(bytes_per_token, bytes_per_s) -> tokens per second if reading the weights were the only cost."""
    for b, bw in [(1e9, 1e10), (5e8, 2e10), (1e8, 1e10)]:
        ok, got = safely(predict, b, bw)
        if not ok:
            return verdict(False, "", got)
        if not isinstance(got, (int, float)) or abs(got - bw / b) > 1e-6 * bw / b:
            return verdict(False, "", f"for {b:.0e} bytes at {bw:.0e} B/s you said {got!r}. Hint: one token needs "
                           "every byte once, so tokens per second = bandwidth / bytes per token")
    guess = predict(bytes_per_token, read_bytes_per_s)
    ratio = measured_tokens_per_s / guess
    return verdict(True, f"the ceiling says {guess:.0f} tok/s; measured {measured_tokens_per_s:.0f} tok/s "
                   f"({ratio:.0%} of it: the rest is the kernel and the other operators)", "")


def check_int8(quantize) -> bool:
    """quantize(w) -> (q int8 (N, K), scale (N,)) with w ~ q * scale[:, None], one scale per row."""
    w = torch.randn(48, 80) * torch.linspace(0.1, 3, 48)[:, None]
    ok, got = safely(quantize, w.clone())
    if not ok:
        return verdict(False, "", got)
    try:
        q, scale = got
        error = float((q.float() * scale.float()[:, None] - w).abs().max())
    except Exception as err:  # noqa: BLE001
        return verdict(False, "", f"return (q, scale) tensors; got {type(got).__name__} ({err})")
    if q.dtype != torch.int8 or scale.shape != (48,):
        return verdict(False, "", f"q must be int8 (48, 80) and scale (48,), got {q.dtype} {tuple(q.shape)} and "
                       f"{tuple(scale.shape)}. Hint: scale = max |w| of the row / 127")
    ref_q, ref_scale = quantize_int8(w)
    reference = float((ref_q.float() * ref_scale[:, None] - w).abs().max())
    if error > reference * 1.01 + 1e-7:
        return verdict(False, "", f"your largest error is {error:.4f}, the kernel's quantization gets {reference:.4f}. "
                       "Hint: round(w / scale), clamp to [-127, 127], one scale per ROW")
    return verdict(True, f"largest error {error:.4f}, half a step of the widest row at most", "")


def check_block(block_params) -> bool:
    """block_params(w32) -> (scale, minimum) of one 32-weight block, the Q4_1 rule: 16 levels from min to max."""
    torch.manual_seed(0)
    for _ in range(3):
        w = torch.randn(32) * 0.05
        ok, got = safely(block_params, w.clone())
        if not ok:
            return verdict(False, "", got)
        _, scale, low = quantize_int4(w[None])
        try:
            s, m = (float(v) for v in got)
        except Exception as err:  # noqa: BLE001
            return verdict(False, "", f"return (scale, minimum) as two numbers; got {got!r} ({err})")
        if abs(s - float(scale)) > 1e-6 or abs(m - float(low)) > 1e-6:
            return verdict(False, "", f"you said scale {s:.5f}, minimum {m:.5f}; the rule gives {float(scale):.5f} and "
                           f"{float(low):.5f}. Hint: minimum = min(w), scale = (max(w) - min(w)) / 15")
    return verdict(True, "16 levels from the block's minimum to its maximum: the file's own rule", "")
