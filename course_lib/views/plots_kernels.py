"""Pictures of lesson 16's attention kernels: the score matrix's size, tiles and their running maximum, a block
table walked block by block, and the paged decode step against the gather.

What it does: draws what attention_kernels computed and measure.attention measured; every plot_* takes data (and
ax=None where it is one panel) and returns the Axes (or the Figure for multi-panel views).
What it does not do: compute attention or measure anything.
"""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Rectangle

from .html_views import PALETTE
from .plots import axes_or_new


def plot_score_memory(tokens: list[int], score_bytes: list[int], kv_bytes: list[int], weight_bytes: int, ax=None,
                      title: str = "One layer's score matrix against the whole model's weights"):
    """MB against context length (log scale): the T x T scores of one layer's heads, the KV cache of every layer,
    and the model's weights as a horizontal line."""
    ax = axes_or_new(ax)
    ax.plot(tokens, [b / 1e6 for b in score_bytes], "o-", color=PALETTE[3], label="scores, one layer (T x T x heads)")
    ax.plot(tokens, [b / 1e6 for b in kv_bytes], "o-", color=PALETTE[0], label="KV cache, all layers (T)")
    ax.axhline(weight_bytes / 1e6, color="grey", ls="--", label="weights (float32)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens in the context")
    ax.set_ylabel("MB")
    ax.legend(fontsize=8)
    ax.set_title(title)
    return ax


def plot_tiles(trace: list, tokens: int, tile_q: int, tile_k: int, query_tile: int, head: int = 0):
    """Left: the grid of (query tile, key tile) pairs, computed ones shaded (the order of computation written in
    each), skipped ones blank, the tiles of `query_tile` outlined. Right: the running maximum of that query tile's
    rows (head `head`) after each key tile: it only grows, and each growth rescales what was summed before."""
    fig, (grid, lines) = plt.subplots(1, 2, figsize=(11, 4.2))
    n_q, n_k = -(-tokens // tile_q), -(-tokens // tile_k)
    for order, (qs, ks, _) in enumerate(trace):
        i, j = qs // tile_q, ks // tile_k
        mine = qs == query_tile
        grid.add_patch(Rectangle((j, i), 1, 1, facecolor=PALETTE[1] if mine else PALETTE[0], alpha=0.85 if mine else 0.35,
                                 edgecolor="white"))
        if n_q * n_k <= 100:
            grid.text(j + 0.5, i + 0.5, str(order + 1), ha="center", va="center", fontsize=7)
    grid.set_xlim(0, n_k)
    grid.set_ylim(n_q, 0)
    grid.set_xlabel(f"key tile ({tile_k} keys each)")
    grid.set_ylabel(f"query tile ({tile_q} queries each)")
    grid.set_title(f"{len(trace)} tiles computed, {n_q * n_k - len(trace)} skipped (after the diagonal)")
    steps = [m[0, head].float().cpu().numpy() for qs, _, m in trace if qs == query_tile]  # (tq,) per key tile
    if steps:
        running = np.stack(steps)  # (key tiles, tq)
        for row in range(0, running.shape[1], max(1, running.shape[1] // 6)):
            lines.plot(range(1, len(running) + 1), running[:, row], "o-", ms=3, label=f"query {query_tile + row}")
        lines.legend(fontsize=7)
    lines.set_xlabel("key tiles seen")
    lines.set_ylabel("running max of the scores")
    lines.set_title(f"Query tile at {query_tile}, head {head}: the running maximum")
    fig.tight_layout()
    return fig


def plot_block_walk(blocks: list[int], shares: list[float], ax=None,
                    title: str = "One row's blocks, walked in order: each block's share of the attention"):
    """A bar per logical block (labelled with its physical block): the share of the softmax mass its keys hold,
    averaged over heads (the weight the merge gives its partial result)."""
    ax = axes_or_new(ax)
    ax.bar(range(len(blocks)), shares, color=PALETTE[0])
    ax.set_xticks(range(len(blocks)))
    ax.set_xticklabels([f"{i}\n→{b}" for i, b in enumerate(blocks)], fontsize=7)
    ax.set_xlabel("logical block → physical block in the pool")
    ax.set_ylabel("share of the softmax mass")
    ax.set_title(title)
    return ax


def plot_decode_attention(by_context: list[dict], by_block: list[dict]):
    """Left: ms per decode step against tokens per row, through the tables and gathered (median, bars from the
    fastest to the slowest repeat). Right: the same at one context for several block sizes. Each dict: tokens,
    block_size, paged_ms, gather_ms and their *_range_ms (measure.attention.step_times)."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    x = [r["tokens"] for r in by_context]

    def spread(rows, name):  # error bars from the median to the fastest and slowest of the repeats
        lo_hi = [r.get(f"{name}_range_ms", (r[f"{name}_ms"],) * 2) for r in rows]
        return [[r[f"{name}_ms"] - lo for r, (lo, _) in zip(rows, lo_hi)], [hi - r[f"{name}_ms"] for r, (_, hi) in zip(rows, lo_hi)]]

    left.errorbar(x, [r["gather_ms"] for r in by_context], yerr=spread(by_context, "gather"), fmt="o-", capsize=3,
                  color=PALETTE[3], label="gather, then attention")
    left.errorbar(x, [r["paged_ms"] for r in by_context], yerr=spread(by_context, "paged"), fmt="o-", capsize=3,
                  color=PALETTE[0], label="through the block tables")
    left.set_xlabel(f"tokens per row ({by_context[0]['rows']} rows)")
    left.set_ylabel("ms per decode step (whole model)")
    left.legend(fontsize=8)
    left.set_title("Decode step against context")
    sizes = [str(r["block_size"]) for r in by_block]
    pos = np.arange(len(sizes))
    right.bar(pos - 0.2, [r["gather_ms"] for r in by_block], 0.4, yerr=spread(by_block, "gather"), capsize=3,
              color=PALETTE[3], label="gather")
    right.bar(pos + 0.2, [r["paged_ms"] for r in by_block], 0.4, yerr=spread(by_block, "paged"), capsize=3,
              color=PALETTE[0], label="through the tables")
    right.set_xticks(pos)
    right.set_xticklabels(sizes)
    right.set_xlabel(f"block size (tokens), {by_block[0]['rows']} rows x {by_block[0]['tokens']} tokens")
    right.set_ylabel("ms per decode step")
    right.legend(fontsize=8)
    right.set_title("Decode step against block size")
    fig.tight_layout()
    return fig
