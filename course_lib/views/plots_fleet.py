"""Pictures of lesson 18, beyond one machine: the router's policies side by side, the bytes a prompt ships from
prefill to decode, a tensor-parallel step split into compute and all-reduce, and a fleet's devices against the
request rate.

What it does: draws what measure/router, measure/fleet and serve/fleet_plan produced; every plot_* takes data and
ax=None and returns the Axes.
What it does not do: compute or measure anything.
"""
from __future__ import annotations

import numpy as np

from .html_views import PALETTE
from .plots import axes_or_new


def plot_policies(runs: dict, axes=None, title: str = "The same trace, three ways to serve it"):
    """Two panels: the prefix hit rate per run, and time to first token (p50 bar, p99 tick) per run."""
    import matplotlib.pyplot as plt
    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(10, 3.5), layout="constrained")
    names = list(runs)
    x = np.arange(len(names))
    hit, ttft = axes
    hit.bar(x, [100 * runs[n]["hit_rate"] for n in names], color=PALETTE[0])
    hit.set_xticks(x, [n.replace("_", " ") for n in names])
    hit.set_ylabel("% of prompt tokens found cached")
    hit.set_ylim(0, 100)
    hit.set_title("prefix cache hits, all replicas")
    ttft.bar(x, [runs[n]["ttft_p50_s"] for n in names], color=PALETTE[1], label="p50")
    ttft.scatter(x, [runs[n]["ttft_p99_s"] for n in names], marker="_", s=500, color="black", label="p99")
    ttft.set_xticks(x, [n.replace("_", " ") for n in names])
    ttft.set_ylabel("seconds to first token")
    ttft.legend(fontsize=8)
    ttft.set_title("time to first token")
    axes[0].figure.suptitle(title)
    return axes


def plot_shipped(rows: dict, ax=None, title: str = "Bytes a prompt ships from prefill to decode"):
    """Bars per wire format: bytes per prompt token (the seconds on the wire written on each bar)."""
    ax = axes_or_new(ax)
    names = list(rows)
    per_token = [rows[n]["bytes_per_prompt_token"] for n in names]
    bars = ax.bar(names, per_token, color=PALETTE[0])
    for bar, n in zip(bars, names):
        ax.annotate(f"{1000 * rows[n]['wire_s']:.0f} ms on the wire", (bar.get_x() + bar.get_width() / 2,
                    bar.get_height()), ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("bytes per prompt token")
    ax.set_title(title)
    return ax


def plot_tp_split(tp: dict, ax=None, title: str = "One decode step: one process against tensor parallelism"):
    """Two stacked bars: the step in one process, and the split step as compute plus all-reduce (waiting included)."""
    ax = axes_or_new(ax)
    share = tp["allreduce_share"]
    labels = ["one process", f"TP = {tp['world']}"]
    compute = [tp["step_ms_one_process"], tp["step_ms_tp"] * (1 - share)]
    reduce = [0.0, tp["step_ms_tp"] * share]
    ax.bar(labels, compute, color=PALETTE[0], label="compute (and everything but the all-reduce)")
    ax.bar(labels, reduce, bottom=compute, color=PALETTE[1], label=f"{tp['allreduces_per_step']} all-reduces")
    ax.set_ylabel("ms per decode step")
    ax.legend(fontsize=8)
    ax.set_title(title)
    return ax


def plot_fleet_curve(points: list[dict], rates: list[float], ax=None, title: str = "Devices against request rate"):
    """Decode and prefill devices per request rate, stacked, from fleet_plan.curve."""
    ax = axes_or_new(ax)
    decode = [p["decode_devices"] for p in points]
    prefill = [p["prefill_devices"] for p in points]
    ax.stackplot(rates, decode, prefill, labels=["decode devices", "prefill devices"], colors=PALETTE[:2], alpha=0.8)
    ax.set_xlabel("requests per second")
    ax.set_ylabel("devices")
    ax.legend(fontsize=8, loc="upper left")
    ax.set_title(title)
    return ax


def plot_gaps(gaps: dict, ax=None, title: str = "A running answer's longest wait while a long prompt is read"):
    """Bars: the running request's p99 gap between tokens (median as a tick), prefill in another process against one
    process reading the prompt whole and in chunks."""
    ax = axes_or_new(ax)
    names = ["disaggregated", "one_process_whole", "one_process_chunked"]
    labels = ["prefill in another\nprocess", "one process,\nwhole prompt", f"one process,\nchunks of {gaps['budget']}"]
    ax.bar(labels, [gaps[n]["p99_gap_s"] for n in names], color=[PALETTE[0], PALETTE[1], PALETTE[2]], label="p99 gap")
    ax.scatter(labels, [gaps[n]["median_gap_s"] for n in names], marker="_", s=500, color="black", label="median gap")
    ax.set_ylabel("seconds between two tokens")
    ax.legend(fontsize=8)
    ax.set_title(title)
    return ax
