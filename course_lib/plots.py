"""Pictures of data the other modules computed. Every plot_* takes data (and ax=None), returns the Axes.

What it does: draws with matplotlib only; no model calls, no widgets, so each works headless and in
a rendered page. What it does not do: compute anything worth testing on its own.
"""
from __future__ import annotations

import matplotlib.pyplot as plt

PALETTE = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C"]


def _axes(ax, size=(7, 3.5)):
    if ax is None:
        _, ax = plt.subplots(figsize=size, layout="constrained")
    return ax


def plot_step_times(labels: list[str], seconds: list[float], ax=None, title: str = "Where the time went"):
    """Horizontal bars, one per pipeline step, in milliseconds, with the value written on each bar."""
    ax = _axes(ax, (7, 0.45 * len(labels) + 1))
    ms = [s * 1000 for s in seconds]
    bars = ax.barh(labels, ms, color=[PALETTE[i % len(PALETTE)] for i in range(len(labels))])
    ax.invert_yaxis()
    ax.bar_label(bars, labels=[f"{m:.1f} ms" for m in ms], padding=3, fontsize=8)
    ax.set_xlabel("milliseconds (measured in this run)")
    ax.set_xlim(0, max(ms) * 1.25 if ms else 1)
    ax.set_title(title)
    return ax


def plot_top_candidates(texts: list[str], probs: list[float], ax=None, highlight: str | None = None,
                        title: str = "Next-token probabilities"):
    """Bar chart of the top candidates; token text shown with visible spaces; `highlight` in a second colour."""
    ax = _axes(ax)
    shown = [repr(t)[1:-1].replace(" ", "␣") for t in texts]
    colours = [PALETTE[1] if highlight is not None and t.strip() == highlight else PALETTE[0] for t in texts]
    bars = ax.bar(range(len(probs)), probs, color=colours)
    ax.set_xticks(range(len(probs)), shown, rotation=45, ha="right")
    ax.bar_label(bars, labels=[f"{p:.2f}" for p in probs], fontsize=7)
    ax.set_ylabel("probability")
    ax.set_ylim(0, min(1.0, max(probs) * 1.2) if probs else 1)
    ax.set_title(title)
    return ax


def plot_token_probs(texts: list[str], probs: list[float], ax=None, title: str = "Probability of each chosen token"):
    """One bar per generated token: how sure the model was when it picked it."""
    ax = _axes(ax)
    shown = [repr(t)[1:-1].replace(" ", "␣") for t in texts]
    ax.bar(range(len(probs)), probs, color=PALETTE[2])
    ax.set_xticks(range(len(probs)), shown, rotation=45, ha="right")
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("probability when chosen")
    ax.set_title(title)
    return ax
