"""Memory bandwidth: the two rates a roofline needs (lesson 12).

What it does: `read_bandwidth` is the machine's streaming read rate (a sum over a buffer far larger than the
caches); `kernel_bandwidth` is one weight format's kernel rate on this model's shapes, each call made after
the caches were flushed, so that it reads from memory, as a decode step does.
What it does not do: define the formats (formats.py does) or measure a compute ceiling (roofline.py does).
"""
from __future__ import annotations

import time

import torch

from ..runner.formats import FORMATS, make_linear
from .roofline import probe_bytes


def read_bandwidth(megabytes: int | None = None, repeats: int = 3, device="cpu") -> float:
    """Bytes per second the machine streams from memory: a sum over a buffer far larger than the caches
    (each byte read once), best of `repeats`. This is the ceiling a decode step's weight read can reach.
    megabytes: the buffer's size; None -> roofline.probe_bytes() (1 GiB, or twice the last-level cache)."""
    megabytes = megabytes or probe_bytes() // 2**20
    buf = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32, device=device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        float(buf.sum())
        best = min(best, time.perf_counter() - start)
    return buf.numel() * 4 / best


def layer_copies(name: str, shapes: list[tuple[int, int]], megabytes: int) -> list:
    """Layers of one format, the given (out, in) shapes repeated until they hold `megabytes`, each copy in its
    own memory (a float32 Linear may keep the very tensor it is given: each copy gets a clone)."""
    import math
    dtype, kind, _ = FORMATS[name]
    sources = [torch.randn(n, k) * 0.02 for n, k in shapes]
    one_set = [make_linear(w.clone(), kind, dtype) for w in sources]
    copies = math.ceil(megabytes * 2**20 / sum(layer.nbytes for layer in one_set))
    return one_set + [make_linear(w.clone(), kind, dtype) for _ in range(copies - 1) for w in sources]


def kernel_bandwidth(name: str, shapes: list[tuple[int, int]], megabytes: int = 256, repeats: int = 3) -> float:
    """Bytes per second one format's kernel reads on matrices of these (out, in) shapes, batch 1: enough copies
    of each matrix to hold `megabytes` in this format, called one after another as a decode step calls its
    layers, after a sum over a buffer of 1 GiB or twice the last-level cache (roofline.probe_bytes) has pushed them
    out of the caches. The flush is not timed; best pass of `repeats`."""
    dtype = FORMATS[name][0]
    layers = layer_copies(name, shapes, megabytes)
    xs = {k: torch.randn(1, k, dtype=dtype) for _, k in shapes}
    inputs = [xs[layer.in_features] for layer in layers]
    flush = torch.ones(probe_bytes() // 4, dtype=torch.float32)
    for layer, x in zip(layers[:len(shapes)], inputs):
        layer(x)  # warm-up: a kernel's first call may allocate
    best = float("inf")
    for _ in range(repeats):
        float(flush.sum())
        start = time.perf_counter()
        for layer, x in zip(layers, inputs):
            layer(x)
        best = min(best, time.perf_counter() - start)
    return sum(layer.nbytes for layer in layers) / best
