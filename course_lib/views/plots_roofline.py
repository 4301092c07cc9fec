"""Pictures of where a step's time is bound (lessons 08 and 12): the roofline with both ceilings measured, and
which parts of the model break first when rounded further.

What it does: draws what measure.roofline, measure.memory and measure.quality measured: `plot_decode_bytes` (time
per token against bytes per token, beside the time the read rate alone predicts), `plot_roofline` (attainable
FLOP/s against arithmetic intensity), `plot_layer_sensitivity`; every plot_* takes data (and ax=None) and
returns the Axes.
What it does not do: measure anything.
"""
from __future__ import annotations

import numpy as np

from .html_views import PALETTE
from .plots import axes_or_new, spread_bars


def plot_decode_bytes(names: list[str], bytes_per_token: list[float], ms_per_token: list[float], read_bytes_per_s: float,
                      ax=None, title: str = "Decode: time per token against bytes per token", spread=None):
    """One point per weight format, on log-log axes; the line is the time a measured read bandwidth predicts
    (bytes / bandwidth): a point on it is bound by memory, a point above it by its kernel.
    spread: (fastest, slowest) ms of the steps behind each point, drawn as a bar."""
    ax = axes_or_new(ax, (7, 4))
    lo, hi = min(bytes_per_token) / 1.5, max(bytes_per_token) * 1.5
    ax.plot([lo / 1e6, hi / 1e6], [lo / read_bytes_per_s * 1000, hi / read_bytes_per_s * 1000], "--",
            color=PALETTE[7], label=f"reading at {read_bytes_per_s / 1e9:.1f} GB/s (measured)")
    for i, (name, b, ms) in enumerate(zip(names, bytes_per_token, ms_per_token)):
        ax.scatter([b / 1e6], [ms], color=PALETTE[i % len(PALETTE)], zorder=3)
        if spread is not None:
            spread_bars(ax, [b / 1e6], [ms], [spread[i][0]], [spread[i][1]], PALETTE[i % len(PALETTE)])
        ax.annotate(name, (b / 1e6, ms), textcoords="offset points", xytext=(5, 4), fontsize=9)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("MB read per token (every weight once)")
    ax.set_ylabel("ms per decode step")
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title(title)
    return ax


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


def plot_roofline(labels: list[str], intensities: list[float], flops_per_s: list[float], peak_flops: float,
                  bytes_per_s: float, ax=None, title: str = "Measured steps under this machine's two ceilings",
                  other_peaks: dict[str, float] | None = None):
    """Log-log: attainable FLOP/s = min(peak, intensity x bandwidth), the ridge point marked, one point per
    measured step (coloured by their label's first word). other_peaks: more compute roofs (name -> FLOP/s),
    dashed, for example another dtype's matrix product."""
    ax = axes_or_new(ax, (7.5, 4.5))
    ridge = peak_flops / bytes_per_s
    top = max([peak_flops, *(other_peaks or {}).values()])
    lo, hi = min(min(intensities) / 3, ridge / 10), max(max(intensities) * 3, top / bytes_per_s * 3)
    xs = np.geomspace(lo, hi, 200)
    ax.plot(xs, np.minimum(peak_flops, xs * bytes_per_s) / 1e9, color=PALETTE[7],
            label=f"roof: {bytes_per_s / 1e9:.1f} GB/s read, {peak_flops / 1e9:.0f} GFLOP/s product (measured)")
    for i, (name, other) in enumerate((other_peaks or {}).items()):
        ax.plot(xs, np.minimum(other, xs * bytes_per_s) / 1e9, "--", color=PALETTE[(5 + i) % len(PALETTE)],
                label=f"{name}: {other / 1e9:.0f} GFLOP/s (measured)")
    ax.axvline(ridge, color=PALETTE[7], linestyle=":", linewidth=1)
    ax.annotate(f"ridge {ridge:.1f} FLOP/byte", (ridge, peak_flops / 1e9), textcoords="offset points",
                xytext=(4, -14), fontsize=8)
    kinds = sorted({label.split()[0] for label in labels})
    for label, x, y in zip(labels, intensities, flops_per_s):
        ax.scatter([x], [y / 1e9], color=PALETTE[kinds.index(label.split()[0]) % len(PALETTE)], zorder=3)
        ax.annotate(label, (x, y / 1e9), textcoords="offset points", xytext=(4, 3), fontsize=7)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP per byte moved)")
    ax.set_ylabel("GFLOP/s")
    ax.legend(loc="lower right", fontsize=7)
    ax.set_title(title)
    return ax
