"""Pictures of where a step's time is bound (lessons 08 and 12): the roofline with both ceilings measured, and
which parts of the model break first when rounded further.

What it does: draws what measure.roofline and measure.quality measured; every plot_* takes data (and ax=None)
and returns the Axes.
What it does not do: measure anything.
"""
from __future__ import annotations

import numpy as np

from .plots import PALETTE, axes_or_new


def plot_layer_sensitivity(per_layer: list[float], base: float, head: float, scheme: str, ax=None,
                           title: str = "Perplexity with one part rounded further"):
    """One bar per layer (that layer alone rounded by `scheme`), the head's bar at the end, float32's line."""
    ax = axes_or_new(ax, (8, 3.5))
    x = np.arange(len(per_layer) + 1)
    ax.bar(x[:-1], per_layer, color=PALETTE[0], label="one layer rounded")
    ax.bar(x[-1:], [head], color=PALETTE[3], label="the output head rounded")
    ax.axhline(base, color=PALETTE[7], linestyle="--", label=f"as the file stores it ({base:.2f})")
    ax.set_xticks(x, [str(i) for i in range(len(per_layer))] + ["head"], fontsize=7)
    ax.set_yscale("log")
    ax.set_xlabel("part rounded")
    ax.set_ylabel("perplexity (log scale)")
    ax.set_title(f"{title}: {scheme}")
    ax.legend(fontsize=8)
    return ax
