"""Checks for 16_attention_kernels: merging two running sums, the bytes the gather copies, the tiles causal attention
computes. Each check draws fresh cases every run (besides the edge cases it always tries) and never prints the
expected value: a hint says what to look at instead."""
from __future__ import annotations

import math
import random

import torch

from ..runner.attention_kernels import tiled_attention
from . import check_prediction, safely, verdict


def check_merge(merge_sums) -> bool:
    """merge_sums(m1, l1, m2, l2) -> (m, l): the running max and sum of exp(x - m) over two pieces together."""
    rng = random.Random()
    cases = [(-math.inf, 0.0, 2.0, 1.0), (0.0, 3.0, 0.0, 3.0), (1.0, 2.0, 3.0, 1.5)]
    cases += [(rng.uniform(-5, 5), rng.uniform(0.5, 9), rng.uniform(-5, 5), rng.uniform(0.5, 9)) for _ in range(4)]
    for m1, l1, m2, l2 in cases:
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
            return verdict(False, "", f"for pieces (m={m1:.3f}, l={l1:.3f}) and (m={m2:.3f}, l={l2:.3f}) you said "
                           f"({gm:.3f}, {gl:.3f}), which is not right. Hint: each sum was taken against its own maximum; "
                           "bring both to the larger one (a piece with m = -inf holds nothing)")
    return verdict(True, "the same rule merges whole attention results, weighted by their share of the mass", "")


def check_gather_bytes(gather_bytes) -> bool:
    """gather_bytes(rows, tokens) -> bytes one decode step's gather writes on SmolLM2 in float32 (every layer)."""
    rng = random.Random()
    for rows, tokens in [(1, 1)] + [(rng.randint(1, 16), rng.randint(2, 8000)) for _ in range(4)]:
        ok, got = safely(gather_bytes, rows, tokens)
        if not ok:
            return verdict(False, "", got)
        if got != 2 * 30 * rows * tokens * 3 * 64 * 4:
            return verdict(False, "", f"for {rows} rows of {tokens} tokens you said {got!r}, which is not right. Hint: "
                           "keys and values, every layer, every key/value head of D numbers, 4 bytes each (the set-up "
                           "cell printed the shapes)")
    return verdict(True, "8 rows of 2,000 tokens: 737 MB copied and read back at every step, more than the float32 "
                   "weights", "")


def check_tiles(tiles_computed) -> bool:
    """tiles_computed(tokens, tile) -> tiles causal attention computes with square tiles (the others are skipped).
    Checked against tiled_attention's own count."""
    rng = random.Random()
    for tokens, tile in [(16, 16), (5, 1), (100, 16)] + [(rng.randint(2, 300), rng.choice([8, 16, 32, 64])) for _ in range(3)]:
        ok, got = safely(tiles_computed, tokens, tile)
        if not ok:
            return verdict(False, "", got)
        trace = []
        x = torch.zeros(1, 1, tokens, 4)
        tiled_attention(x, x, x, tile_q=tile, tile_k=tile, trace=trace)
        if got != len(trace):
            return verdict(False, "", f"for {tokens} tokens in tiles of {tile} you said {got!r}; tiled_attention computed "
                           "a different number. Hint: count the tiles per side (a last, partial tile counts too); query "
                           "tile i needs key tiles 0 to i")
    return verdict(True, "about half the tiles: causal attention skips the rest without reading them", "")


def check_step_prediction(prediction_ms, model, tokens: int = 2000, rows: int = 4, tolerance: float = 1.5) -> bool:
    """prediction_ms: your prediction, written BEFORE this runs, of one decode step through the block tables for
    `rows` rows of `tokens` tokens each (section 6 measured 250, 500 and 1,000). The check measures it."""
    from ..measure.attention import step_times
    return check_prediction(prediction_ms, lambda: step_times(model, rows, tokens, 16, repeats=3)["paged_ms"], unit="ms",
                            what=f"per step, {rows} rows x {tokens:,} tokens, through the tables",
                            tolerance=tolerance, timed=True, hint="The weights cost the same at any context; the cache's share "
                                                      "grows in a straight line with it: extend the printed points")
