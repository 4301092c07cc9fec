"""Memory bandwidth: the two rates a roofline needs (lesson 12).

What it does: `read_bandwidth` is the machine's streaming read rate (a sum over a buffer far larger than the
caches); `kernel_bandwidth` is one weight format's kernel rate on this model's shapes, with enough copies of
each matrix that every call reads from memory, as a decode step does.
What it does not do: define the formats (formats.py does) or measure a compute ceiling.
"""
from __future__ import annotations

import time

import torch

from ..formats import FORMATS, make_linear


def read_bandwidth(megabytes: int = 1024, repeats: int = 3, device="cpu") -> float:
    """Bytes per second the machine streams from memory: a sum over a buffer far larger than the caches
    (each byte read once), best of `repeats`. This is the ceiling a decode step's weight read can reach."""
    buf = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32, device=device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        float(buf.sum())
        best = min(best, time.perf_counter() - start)
    return buf.numel() * 4 / best


def kernel_bandwidth(name: str, shapes: list[tuple[int, int]], copies: int = 8, repeats: int = 3) -> float:
    """Bytes per second one format's kernel reads on matrices of these (out, in) shapes, batch 1, with enough
    copies of each that they do not fit the caches (so every call reads from memory, as in decode)."""
    dtype, kind, _ = FORMATS[name]
    layers = [make_linear(torch.randn(n, k) * 0.02, kind, dtype) for _ in range(copies) for n, k in shapes]
    xs = {k: torch.randn(1, k, dtype=dtype) for _, k in shapes}
    inputs = [xs[k] for _ in range(copies) for _, k in shapes]
    for layer, x in zip(layers, inputs):
        layer(x)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for layer, x in zip(layers, inputs):
            layer(x)
        best = min(best, time.perf_counter() - start)
    return sum(layer.nbytes for layer in layers) / best
