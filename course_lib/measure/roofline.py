"""The roofline (lessons 08 and 12): both ceilings measured in one run, and each step placed under them.

What it does: `compute_ceiling` (floating-point operations per second of a large matrix product in a dtype: the
most arithmetic this machine does per second that way), `last_level_cache_bytes` and `probe_bytes` (how large a
bandwidth probe must be to read from memory rather than from a cache), `step_work` (the operations and bytes of
a prefill or a decode step: the weights' products, attention's own products over the cache, the weights read,
the KV cache read and written), `place` (a measured step's arithmetic intensity, attained rate, its roof and
which ceiling binds it).
What it does not do: time the steps (measure.bench's prefill_seconds and decode_seconds do), count the
activations' bytes (small beside the weights at these lengths; a lower bound on the bytes, so the intensity is an
upper bound), or draw (plots_roofline).
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from ..runtime import synchronize


def compute_ceiling(dtype=torch.float32, n: int = 2048, repeats: int = 3, device="cpu", enough: float = 0.1) -> float:
    """FLOP/s of an n x n by n x n matrix product (2 n^3 operations), best of `repeats` after a warm-up, with the
    thread count torch has now. The compute roof: no step does more arithmetic per second in this dtype.
    The size starts at 256 and doubles up to n while one product takes under `enough` seconds: a dtype this CPU
    has no fast kernel for (bfloat16 without AVX-512 BF16 or AMX: about 1 GFLOP/s on an AVX2-only AMD EPYC, where
    one 2,048 product takes over a minute) is measured on a smaller product instead of stalling the lesson."""
    size = min(256, n)
    while True:
        a = torch.randn(size, size, device=device).to(dtype)
        b = torch.randn(size, size, device=device).to(dtype)
        synchronize(device)
        start = time.perf_counter()
        a @ b  # warm-up: the library picks its kernel and allocates
        synchronize(device)
        if size >= n or time.perf_counter() - start >= enough:
            break
        size = min(2 * size, n)
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        a @ b
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * size ** 3 / best


def last_level_cache_bytes() -> int | None:
    """The largest cache this CPU reports (Linux sysfs), in bytes; None where it is not reported."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip().upper()
        except OSError:
            continue
        unit = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KMG")) * unit)
    return max(sizes) if sizes else None


def probe_bytes(minimum: int = 2 ** 30) -> int:
    """Bytes a bandwidth probe reads: at least `minimum` and twice the last-level cache, so that most bytes come
    from memory (a larger buffer changed nothing measurable on the course's machine, and a workshop laptop has the
    memory to spare only once). Example: a 32 MB cache -> 1 GiB; a reported 1 GiB cache -> 2 GiB."""
    llc = last_level_cache_bytes() or 0
    return max(minimum, 2 * llc)


def step_work(model_config, matmul_flops_per_token: float, weight_bytes: float, kv_bytes_per_token: float,
              new_tokens: int, context: int) -> dict:
    """Operations and bytes of one forward pass that adds `new_tokens` to a cache holding `context` tokens
    (prefill: context 0; decode: new_tokens 1).
    flops: the weights' products (matmul_flops_per_token per token) plus attention's own: each new token's scores
    and weighted sum over every key it sees, 4 x layers x heads x head_dim per (token, key) pair.
    bytes: every weight once, the cache's `context` tokens read and the new tokens' keys and values written.
    Example: decode at context 0 -> bytes = weights + one token's cache"""
    L, H = model_config.num_hidden_layers, model_config.num_attention_heads
    D = getattr(model_config, "head_dim", None) or model_config.hidden_size // H
    pairs = new_tokens * context + new_tokens * (new_tokens + 1) / 2  # causal: token i sees context + i + 1 keys
    attention = 4.0 * L * H * D * pairs
    flops = matmul_flops_per_token * new_tokens + attention
    nbytes = weight_bytes + kv_bytes_per_token * (context + new_tokens)
    return {"flops": flops, "attention_flops": attention, "bytes": nbytes, "new_tokens": new_tokens, "context": context}


def place(work: dict, seconds: float, peak_flops: float, bytes_per_s: float) -> dict:
    """Where a measured step sits: intensity (FLOP per byte), attained FLOP/s, its roof min(peak, intensity x
    bandwidth), the fraction of that roof reached, and the ceiling that binds it (memory left of the ridge
    point peak / bandwidth, compute right of it)."""
    intensity = work["flops"] / work["bytes"]
    attained = work["flops"] / seconds
    roof = min(peak_flops, intensity * bytes_per_s)
    return {"intensity": intensity, "flops_per_s": attained, "roof": roof, "of_roof": attained / roof,
            "bound": "memory" if intensity * bytes_per_s < peak_flops else "compute",
            "ridge": peak_flops / bytes_per_s}
