"""Pictures of several answers to one prompt (lesson 13, section 7): the blocks n answers hold forked against
separate, and the vote of N sampled answers against N and against the tokens it cost.

What it does: draws what measure/fork measured; every plot_* takes data and ax=None and returns the Axes.
What it does not do: compute or measure anything.
"""
from __future__ import annotations

import numpy as np

from .html_views import PALETTE
from .plots import axes_or_new


def plot_fork_blocks(forked: dict, ax=None, title: str = "Blocks held at the peak: n answers to one prompt"):
    """Bars per n: peak blocks as n separate requests and with the fork, and the fork's bound as a tick."""
    ax = axes_or_new(ax)
    ns = list(forked["rows"])
    x = np.arange(len(ns))
    separate = [forked["rows"][n]["separate_peak_blocks"] for n in ns]
    fork = [forked["rows"][n]["fork_peak_blocks"] for n in ns]
    bound = [forked["rows"][n]["fork_bound_blocks"] for n in ns]
    ax.bar(x - 0.2, separate, 0.4, color=PALETTE[1], label="n separate requests")
    ax.bar(x + 0.2, fork, 0.4, color=PALETTE[0], label="forked (copy-on-write)")
    ax.scatter(x + 0.2, bound, marker="_", s=400, color="black", label="bound: full prompt blocks once + each answer's")
    ax.set_xticks(x, [f"n = {n}" for n in ns])
    ax.set_ylabel(f"blocks of {forked['block_size']} tokens")
    ax.legend(fontsize=8)
    ax.set_title(title)
    return ax


def plot_votes(best: dict, ax=None, title: str = "Majority vote of N sampled answers"):
    """Accuracy against answer tokens per question, one point per N, and greedy's as a star."""
    ax = axes_or_new(ax)
    ns = [str(n) for n in best["ns"]]
    cost = [best["answer_tokens_per_question"][n] for n in ns]
    right = [100 * best["accuracy"][n] for n in ns]
    ax.plot(cost, right, "o-", color=PALETTE[0], label=f"vote of N samples (temperature {best['temperature']})")
    for n, c, r in zip(ns, cost, right):
        ax.annotate(f"N={n}", (c, r), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.scatter([best["greedy_tokens_per_question"]], [100 * best["greedy_accuracy"]], marker="*", s=160,
               color=PALETTE[1], label="greedy, one answer", zorder=3)
    ax.set_xlabel("answer tokens per question (compute)")
    ax.set_ylabel(f"% right of {best['questions']} questions")
    ax.set_ylim(-5, 105)
    ax.legend(fontsize=8)
    ax.set_title(title)
    return ax
