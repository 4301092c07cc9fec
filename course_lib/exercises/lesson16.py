"""Checks for 16_attention_kernels: merging two running sums, the bytes the gather copies, the tiles causal attention computes."""
from __future__ import annotations

import math

import torch

from ..attention_kernels import tiled_attention
from . import safely, verdict


def check_merge(merge_sums) -> bool:
    """merge_sums(m1, l1, m2, l2) -> (m, l): the running max and sum of exp(x - m) over two pieces together."""
    for m1, l1, m2, l2 in [(1.0, 2.0, 3.0, 1.5), (5.0, 1.0, -2.0, 4.0), (0.0, 3.0, 0.0, 3.0), (-math.inf, 0.0, 2.0, 1.0)]:
        ok, got = safely(merge_sums, m1, l1, m2, l2)
        if not ok:
            return verdict(False, "", got)
        m = max(m1, m2)
        l = sum(li * math.exp(mi - m) for mi, li in ((m1, l1), (m2, l2)) if mi != -math.inf)
        try:
            gm, gl = (float(x) for x in got)
        except (TypeError, ValueError):
            return verdict(False, "", f"return a pair (m, l), got {got!r}")
        if gm != m or not math.isclose(gl, l, rel_tol=1e-9):
            return verdict(False, "", f"for pieces (m={m1}, l={l1}) and (m={m2}, l={l2}) you said ({gm}, {gl}), expected "
                           f"({m}, {l:.4f}). Hint: each sum was taken against its own maximum; bring both to the larger one "
                           "(a piece with m = -inf holds nothing)")
    return verdict(True, "the same rule merges whole attention results, weighted by their share of the mass", "")


def check_gather_bytes(gather_bytes) -> bool:
    """gather_bytes(rows, tokens) -> bytes one decode step's gather writes on SmolLM2 in float32 (every layer)."""
    for rows, tokens in [(1, 1), (4, 1000), (8, 2000), (3, 37)]:
        ok, got = safely(gather_bytes, rows, tokens)
        if not ok:
            return verdict(False, "", got)
        want = 2 * 30 * rows * tokens * 3 * 64 * 4
        if got != want:
            return verdict(False, "", f"for {rows} rows of {tokens} tokens you said {got!r}, expected {want:,}. Hint: keys "
                           "and values, 30 layers, 3 key/value heads of 64 numbers, 4 bytes each")
    return verdict(True, f"8 rows of 2,000 tokens: {2 * 30 * 8 * 2000 * 3 * 64 * 4 / 1e6:.0f} MB copied per step, "
                   "a third of the float32 weights", "")


def check_tiles(tiles_computed) -> bool:
    """tiles_computed(tokens, tile) -> tiles causal attention computes with square tiles (the others are skipped).
    Checked against tiled_attention's own count."""
    for tokens, tile in [(64, 16), (100, 16), (16, 16), (5, 1), (130, 64)]:
        ok, got = safely(tiles_computed, tokens, tile)
        if not ok:
            return verdict(False, "", got)
        trace = []
        x = torch.zeros(1, 1, tokens, 4)
        tiled_attention(x, x, x, tile_q=tile, tile_k=tile, trace=trace)
        if got != len(trace):
            return verdict(False, "", f"for {tokens} tokens in tiles of {tile} you said {got!r}; tiled_attention computed "
                           f"{len(trace)}. Hint: n = ceil(tokens / tile) tiles per side; query tile i needs key tiles 0..i")
    return verdict(True, "about half the tiles: causal attention skips the rest without reading them", "")
