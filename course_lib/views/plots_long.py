"""Pictures of lesson 17 (long context): bytes and time per decode step against context, loss along a long text
under each strategy, and the needle grid.

What it does: draws what long_context computed and measure/long_context measured; every plot_* takes data and
ax=None and returns the Axes.
What it does not do: compute or measure anything.
"""
from __future__ import annotations

import numpy as np

from .html_views import PALETTE
from .plots import axes_or_new, spread_bars


def plot_step_bytes(contexts: list[int], weights: dict[str, int], cache_per_token: dict[str, float], ax=None,
                    title: str = "Bytes one decode step reads: weights and cache"):
    """MB per step against context: each weight format as a flat line, each cache format as a line through 0."""
    ax = axes_or_new(ax)
    x = np.array(contexts, dtype=float)
    for i, (name, b) in enumerate(weights.items()):
        ax.axhline(b / 1e6, color=PALETTE[i], ls="--", label=f"weights, {name}")
    for i, (name, per) in enumerate(cache_per_token.items()):
        ax.plot(x, x * per / 1e6, color=PALETTE[2 + i], label=f"cache, {name}")
    ax.set_xlabel("tokens in the context (one row)")
    ax.set_ylabel("MB per decode step")
    ax.legend(fontsize=8)
    ax.set_title(title)
    return ax


def plot_step_curve(curves: dict[str, list[dict]], ax=None, title: str = "Measured time per decode step against context"):
    """Milliseconds per step against context (points: the median; bars: fastest to slowest of the repeats, where the
    curve has them), one series per weight format, each with its least-squares line through the medians."""
    ax = axes_or_new(ax)
    for i, (name, curve) in enumerate(curves.items()):
        x = np.array([c["context"] for c in curve], dtype=float)
        y = np.array([c["ms"] for c in curve])
        slope, intercept = np.polyfit(x, y, 1)
        ax.plot(x, y, "o", color=PALETTE[i], label=f"{name}, measured (median; bars: fastest to slowest)")
        if all("ms_min" in c for c in curve):
            spread_bars(ax, x, y, [c["ms_min"] for c in curve], [c["ms_max"] for c in curve], PALETTE[i])
        ax.plot(x, intercept + slope * x, "-", color=PALETTE[i], alpha=0.5,
                label=f"{name}: {intercept:.1f} ms + {1000 * slope:.2f} ms per 1,000 tokens")
    ax.set_xlabel("tokens in the context")
    ax.set_ylabel("ms per decode step")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    ax.set_title(title)
    return ax


def plot_loss_by_position(runs: dict, budget: int, smooth: int = 64, ax=None,
                          title: str = "Loss per token along the text, at one cache budget"):
    """Each strategy's loss (moving mean over `smooth` tokens) against the token's position; the budget marked."""
    ax = axes_or_new(ax)
    kernel = np.ones(smooth) / smooth
    for i, (name, run) in enumerate(runs.items()):
        loss = np.convolve(run.nll.cpu().numpy(), kernel, mode="valid")
        ax.plot(np.arange(len(loss)) + smooth, loss, color=PALETTE[i % len(PALETTE)], lw=1.2, label=name)
    ax.axvline(budget, color="grey", ls=":", label=f"budget ({budget} tokens)")
    ax.set_xlabel("position in the text (tokens)")
    ax.set_ylabel(f"loss, nats (mean over {smooth} tokens)")
    ax.legend(fontsize=8)
    ax.set_title(title)
    return ax


def plot_needle(cells: list[dict], ax=None, title: str = "Was the number found? (per context length and depth)"):
    """A grid: context length down, depth across; filled where the answer held the secret number."""
    ax = axes_or_new(ax)
    lengths = sorted({c["asked_length"] for c in cells})
    depths = sorted({c["depth"] for c in cells})
    grid = np.zeros((len(lengths), len(depths)))
    for c in cells:
        grid[lengths.index(c["asked_length"]), depths.index(c["depth"])] = float(c["found"])
    ax.imshow(grid, cmap="Greens", vmin=0, vmax=1.3)
    for c in cells:
        ax.text(depths.index(c["depth"]), lengths.index(c["asked_length"]), "found" if c["found"] else "missed",
                ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(depths)), [f"{d:.0%}" for d in depths])
    ax.set_yticks(range(len(lengths)), [f"{n:,}" for n in lengths])
    ax.set_xlabel("depth of the fact in the text")
    ax.set_ylabel("context length (tokens)")
    ax.set_title(title)
    return ax
