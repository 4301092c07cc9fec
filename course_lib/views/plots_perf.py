"""Pictures of measured speed and memory: cache timings, KV memory, budgets, prefill and decode, batching.

What it does: draws data that the measure/ modules measured; every plot_* takes
data (and ax=None where it is one panel) and returns the Axes (or the Figure for multi-panel views).
What it does not do: measure anything.
"""
from __future__ import annotations

import matplotlib.pyplot as plt

from .html_views import PALETTE
from .plots import axes_or_new, spread_bars


def plot_cache_timing(cached: list[float], uncached: list[float], ax=None,
                      title: str = "Time for each new token, with and without the KV cache"):
    """Seconds per new token against its index, both ways (the first token includes the prompt's pass)."""
    ax = axes_or_new(ax)
    ax.plot([s * 1000 for s in uncached], label="no cache: re-run the whole sequence", color=PALETTE[3])
    ax.plot([s * 1000 for s in cached], label="KV cache: one new position per step", color=PALETTE[0])
    ax.set_xlabel("new token index")
    ax.set_ylabel("ms for this token")
    ax.legend(fontsize=8)
    ax.set_title(title)
    return ax


def plot_kv_memory(tokens: list[int], formula_bytes: list[float], measured: dict[int, int] | None = None, ax=None,
                   title: str = "KV cache memory against context length"):
    """The formula as a line, the bytes measured on real cache objects as dots (MB)."""
    ax = axes_or_new(ax)
    ax.plot(tokens, [b / 1e6 for b in formula_bytes], color=PALETTE[0], label="formula")
    if measured:
        ax.plot(list(measured), [b / 1e6 for b in measured.values()], "o", color=PALETTE[1], label="measured cache object")
    ax.set_xlabel("tokens in the cache")
    ax.set_ylabel("MB")
    ax.legend(fontsize=8)
    ax.set_title(title)
    return ax


def plot_budget_runs(outcomes: dict, budget: int, names: list[str]):
    """One panel per policy: cache usage over time against the budget, and each request's fate."""
    fig, axes = plt.subplots(len(outcomes), 2, figsize=(12, 3.2 * len(outcomes)), layout="constrained", squeeze=False)
    colours = {"finished": PALETTE[2], "rejected": PALETTE[7], "evicted": PALETTE[3]}
    for row, (policy, out) in enumerate(outcomes.items()):
        ax = axes[row, 0]
        ax.plot(out.usage, color=PALETTE[0])
        ax.axhline(budget, color="black", linestyle="--", linewidth=1)
        ax.set_ylim(0, budget * 1.15)
        ax.set_xlabel("time (decode steps)")
        ax.set_ylabel("tokens cached")
        ax.set_title(f"'{policy}': tokens cached (dashed: the budget)")
        ax = axes[row, 1]
        for i, name in enumerate(names):
            ticks = [t for t, active in enumerate(out.active) if name in active]
            status = out.status.get(name, "running")
            runs = []  # contiguous stretches: a preempted request holds memory in several
            for t in ticks:
                if runs and t == runs[-1][0] + runs[-1][1]:
                    runs[-1][1] += 1
                else:
                    runs.append([t, 1])
            if runs:
                ax.broken_barh([tuple(r) for r in runs], (i - 0.4, 0.8), color=colours.get(status, PALETTE[4]))
            label = status + (f" (preempted {out.preempted[name]}x)" if out.preempted.get(name) else "")
            if not ticks:
                label += ": never held memory"
            ax.text(ticks[-1] + 2 if ticks else 1, i, label, va="center", fontsize=8)
        ax.set_yticks(range(len(names)), names)
        ax.invert_yaxis()
        ax.set_xlim(0, len(out.usage) * 1.3 + 12)  # room for the longest label after the last bar
        ax.set_xlabel("time (decode steps)")
        ax.set_title(f"'{policy}': when each request held memory\n({out.finished} finished, {out.lost} tokens of "
                     "work lost)")
    return fig


def plot_benchmark(result: dict):
    """Prefill tokens per second against prompt length, and decode ms per token against context."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6), layout="constrained")
    p, d = result["prefill"], result["decode"]
    axes[0].plot([r["tokens"] for r in p], [r["tokens_per_s"] for r in p], "o-", color=PALETTE[0])
    axes[0].set_xscale("log", base=2)
    axes[0].set_xlabel("prompt tokens")
    axes[0].set_ylabel("prefill tokens per second")
    axes[0].set_title("Prefill: tokens per second against prompt length")
    axes[1].plot([r["context"] for r in d], [r["seconds_per_token"] * 1000 for r in d], "o-", color=PALETTE[3])
    axes[1].set_xscale("log", base=2)
    axes[1].set_xlabel("tokens already in the cache")
    axes[1].set_ylabel("ms per decode step")
    axes[1].set_title("Decode: time per token against context length")
    fig.suptitle(f"{result['machine']['name']} ({result['dtype']})")
    return fig


def plot_padding(mask, row_labels: list[str] | None = None, ax=None, title: str = "A left-padded batch"):
    """Grid of a (B, T) attention mask: real tokens coloured, padding grey."""
    import numpy as np
    ax = axes_or_new(ax, (8, 0.5 * len(mask) + 1.2))
    m = np.array(mask)
    ax.imshow(m, cmap="Blues", vmin=-0.3, vmax=1.2, aspect="auto")
    ax.set_yticks(range(len(m)), row_labels or [f"request {i}" for i in range(len(m))])
    ax.set_xlabel("token column (padding on the left, so every row ends in the last column)")
    waste = int((m == 0).sum())
    ax.set_title(f"{title}: {waste} of {m.size} slots are padding ({waste / m.size:.0%})")
    return ax


def plot_throughput_latency(rows: list[dict], ax=None, title: str = "Throughput and latency against batch size"):
    """Twin axes against batch size: aggregate tokens per second (left) and per-request latency (right), each the
    median of the repeats; bars from the fastest to the slowest repeat where the rows have them."""
    ax = axes_or_new(ax)
    sizes = [r["batch"] for r in rows]
    rates, latency = [r["tokens_per_s"] for r in rows], [r["latency_s"] for r in rows]
    ax.plot(sizes, rates, "o-", color=PALETTE[0], label="throughput")
    ax.set_xlabel("batch size")
    ax.set_ylabel("tokens per second (all requests)", color=PALETTE[0])
    ax.set_xscale("log", base=2)
    right = ax.twinx()
    right.plot(sizes, latency, "s--", color=PALETTE[3], label="latency")
    right.set_ylabel("seconds until a request is done", color=PALETTE[3])
    if all("seconds_runs" in r for r in rows):
        fast = [min(r["seconds_runs"]) for r in rows]
        slow = [max(r["seconds_runs"]) for r in rows]
        rate_hi = [r["batch"] * r["new_tokens"] / f for r, f in zip(rows, fast)]
        rate_lo = [r["batch"] * r["new_tokens"] / s for r, s in zip(rows, slow)]
        spread_bars(ax, sizes, rates, rate_lo, rate_hi, PALETTE[0])
        spread_bars(right, sizes, latency, fast, slow, PALETTE[3])
    ax.set_title(title)
    return ax


def plot_timeline(runs: dict[str, list], ax=None, title: str = "When each request ran"):
    """Gantt chart: one row per request and schedule; bar from admission to last token, tick at first token."""
    ax = axes_or_new(ax, (10, 0.35 * sum(len(j) for j in runs.values()) + 1.5))
    y, ticks, labels = 0.0, [], []
    for k, (name, jobs) in enumerate(runs.items()):
        for job in jobs:
            ax.barh(y, job.end - job.start, left=job.start, color=PALETTE[k], alpha=0.8)
            ax.plot(job.first_token, y, "k|", markersize=8)
            ticks.append(y)
            labels.append(f"{name}: {job.name} ({job.new_tokens} tok)")
            y += 1
        y += 0.5  # a gap between schedules
    ax.set_yticks(ticks, labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since all requests were queued (| = first token)")
    ax.set_title(title)
    return ax


def plot_race(names: list[str], tokens_per_s: list[float], ax=None,
              title: str = "The race: same tokens, tokens per second", runs: list[list[float]] | None = None):
    """One bar per contender (for example model.generate and ours), labelled with its rate (the best repeat);
    `runs`: every repeat's rate per contender, drawn as a line from the slowest to the fastest."""
    ax = axes_or_new(ax, (6, 2.6))
    bars = ax.barh(names, tokens_per_s, color=[PALETTE[i % len(PALETTE)] for i in range(len(names))])
    if runs is not None:
        spread_bars(ax, range(len(names)), tokens_per_s, [min(r) for r in runs], [max(r) for r in runs], "black",
                    horizontal=True)
        ax.set_xlabel("tokens per second (decode, batch 1); bar: best repeat, line: slowest to fastest")
    else:
        ax.set_xlabel("tokens per second (decode, batch 1)")
    ends = [max(r) for r in runs] if runs is not None else tokens_per_s
    for bar, v, end in zip(bars, tokens_per_s, ends):
        ax.text(max(end, v), bar.get_y() + bar.get_height() / 2, f"  {v:.1f}", va="center")
    ax.invert_yaxis()
    ax.set_title(title)
    return ax


def plot_layout_gains(rows: list[dict], threshold: float, ax=None,
                      title: str = "The same matrix, read by columns instead of rows"):
    """One bar per matrix (measure.race.layout_gains): how many times faster one token's product is with the
    matrix stored by columns; the dashed line is the gain the model asks for before it switches."""
    ax = axes_or_new(ax, (6.5, 2.8))
    labels = [f"{r['matrix']} {r['shape'][0]}x{r['shape'][1]}" for r in rows]
    colors = [PALETTE[1] if r["layout"] == "columns" else PALETTE[0] for r in rows]
    bars = ax.barh(labels, [r["gain"] for r in rows], color=colors)
    for bar, r in zip(bars, rows):
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {r['gain']:.2f}x, kept by {r['layout']}",
                va="center", fontsize=8)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.axvline(threshold, color="grey", linestyle="--", linewidth=0.8)
    ax.set_xlim(0, max(r["gain"] for r in rows) * 1.6)
    ax.set_xlabel("speed by columns / speed by rows (one token, caches emptied)")
    ax.invert_yaxis()
    ax.set_title(title)
    return ax


def plot_profile(profiles: dict[str, dict[str, float]], ax=None, title: str = "Where a decode step's time goes",
                 wall_ms: dict[str, float] | None = None):
    """Stacked bars of milliseconds per decode step by operator group, one bar per run (model and context).
    wall_ms: each run's wall time per step, drawn as an outline around its bar: the part outside the coloured
    segments is time in no operator (Python between calls, and the profiler's own recording)."""
    ax = axes_or_new(ax, (9, 0.6 * len(profiles) + 1.6))
    if wall_ms:
        ax.barh(list(profiles), [wall_ms[k] for k in profiles], fill=False, edgecolor="#555", linestyle="--",
                label="wall time per step (under the profiler)")
    groups = sorted({g for p in profiles.values() for g in p}, key=lambda g: -sum(p.get(g, 0) for p in profiles.values()))
    left = [0.0] * len(profiles)
    for i, group in enumerate(groups):
        widths = [p.get(group, 0.0) for p in profiles.values()]
        ax.barh(list(profiles), widths, left=left, label=group, color=PALETTE[i % len(PALETTE)])
        left = [a + b for a, b in zip(left, widths)]
    ax.invert_yaxis()
    ax.set_xlabel("ms per decode step (coloured: operator self-time, torch.profiler)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    ax.set_title(title)
    return ax


def plot_paged_memory(contiguous_bytes: list[float], paged_bytes: list[float], ax=None,
                      title: str = "KV memory on the same trace: reserved per request, or held in blocks"):
    """Per scheduler step: what a contiguous cache reserves (each request's prompt + allowance) and the bytes of
    the blocks in use (MB)."""
    ax = axes_or_new(ax)
    ax.plot([b / 1e6 for b in contiguous_bytes], color=PALETTE[3], label="contiguous: prompt + max new tokens each")
    ax.plot([b / 1e6 for b in paged_bytes], color=PALETTE[0], label="paged: blocks in use (shared ones once)")
    ax.set_xlabel("scheduler step")
    ax.set_ylabel("MB")
    ax.legend(fontsize=8)
    ax.set_title(title)
    return ax


def plot_block_tables(tables: dict[str, list[int]], ref: list[int], ax=None,
                      title: str = "Block tables: logical block -> physical block"):
    """One row per sequence, one cell per logical block, labelled with its physical block; cells used by more
    than one sequence (ref > 1) in one colour, private ones in another."""
    width = max(len(t) for t in tables.values())
    ax = axes_or_new(ax, (min(14, 0.32 * width + 2.5), 0.45 * len(tables) + 1.2))
    for row, (name, blocks) in enumerate(tables.items()):
        for col, block in enumerate(blocks):
            shared = ref[block] > 1
            ax.add_patch(plt.Rectangle((col, row), 0.92, 0.85, color=PALETTE[0] if shared else PALETTE[1],
                                       alpha=0.85 if shared else 0.6))
            ax.text(col + 0.46, row + 0.43, str(block), ha="center", va="center", fontsize=6)
    ax.set_xlim(0, width)
    ax.set_ylim(len(tables), 0)
    ax.set_yticks([r + 0.43 for r in range(len(tables))], list(tables), fontsize=8)
    ax.set_xlabel("logical block (cell text: physical block in the pool); blue = shared, orange = its own")
    ax.set_title(title)
    return ax


def plot_paged_runs(runs: dict, budget_blocks: int, names: list[str]):
    """One row per policy: blocks in use over time against the pool, and when each request held blocks (solid)
    or waited in the queue (pale), from the scheduler's events: queued, admitted, preempted, finished or rejected.
    runs: {policy: a run's timeline (measure.trace.TraceRun.timeline(): seconds, blocks_used, events, finished,
    tokens_per_s, recomputed_tokens)}."""
    fig, axes = plt.subplots(len(runs), 2, figsize=(12, 3.2 * len(runs)), layout="constrained", squeeze=False)
    for row, (policy, run) in enumerate(runs.items()):
        ax = axes[row, 0]
        ax.plot([t for t, _ in run["blocks_used"]], [u for _, u in run["blocks_used"]], color=PALETTE[0])
        ax.axhline(budget_blocks, color="black", linestyle="--", linewidth=1)
        ax.set_ylim(0, budget_blocks * 1.15)
        ax.set_xlim(0, run["seconds"] * 1.35)
        ax.set_xlabel("seconds")
        ax.set_ylabel("blocks in use")
        ax.set_title(f"'{policy}': blocks in use (dashed: the pool)")
        ax = axes[row, 1]
        end = run["seconds"]
        for i, name in enumerate(names):
            spans, waits, opened, queued, fate, count, when = [], [], None, None, "running", 0, 0.0
            for t, who, what in run["events"]:
                if who != name:
                    continue
                if what == "queued":
                    queued = t
                elif what == "admitted":
                    opened = t
                    if queued is not None:
                        waits.append((queued, t - queued))
                        queued = None
                elif what == "preempted":
                    spans.append((opened, t - opened))
                    opened, queued, count = None, t, count + 1
                else:
                    fate, when = what, t
                    if opened is not None:
                        spans.append((opened, t - opened))
                        opened = None
            colour = PALETTE[7] if fate == "rejected" else PALETTE[2]
            if waits:
                ax.broken_barh(waits, (i - 0.25, 0.5), color=PALETTE[7], alpha=0.25)
            if spans:
                ax.broken_barh(spans, (i - 0.4, 0.8), color=colour)
            elif fate == "rejected":
                ax.plot(when, i, "x", color=colour)
            label = fate + (f", preempted {count}x" if count else "")
            ax.text((spans[-1][0] + spans[-1][1]) if spans else when, i, " " + label, va="center", fontsize=7)
        ax.set_yticks(range(len(names)), names, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlim(0, end * 1.35)
        ax.set_xlabel("seconds (solid: holding blocks; pale: waiting)")
        ax.set_title(f"'{policy}': {run['finished']} of {len(names)} finished, {run['tokens_per_s']:.1f} tok/s, "
                     f"{run['recomputed_tokens']} tokens recomputed")
    return fig


def plot_block_sizes(rows: list[dict], bytes_per_token: float, ax=None,
                     title: str = "Block size: memory held against table length"):
    """paged.footprint rows: MB the blocks hold (left axis) and block-table entries (right axis) per block size."""
    ax = axes_or_new(ax)
    sizes = [r["block_size"] for r in rows]
    ax.plot(sizes, [r["slots"] * bytes_per_token / 1e6 for r in rows], "o-", color=PALETTE[0], label="MB held")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per block")
    ax.set_ylabel("MB held by the blocks", color=PALETTE[0])
    twin = ax.twinx()
    twin.plot(sizes, [r["table_entries"] for r in rows], "s--", color=PALETTE[1], label="table entries")
    twin.set_yscale("log")
    twin.set_ylabel("block-table entries (log)", color=PALETTE[1])
    ax.set_title(title)
    return ax


def plot_chunked_prefill(labels: list[str], max_gaps: list[float], tokens_per_s: list[float], ax=None,
                         title: str = "A long prompt arrives: the running request's longest wait"):
    """Bars: the longest gap between a running request's tokens for each chunk size (labels); dots on a second
    axis: tokens per second over the same run, so the price of small chunks shows beside what they buy."""
    ax = axes_or_new(ax, (7, 3))
    bars = ax.bar(labels, max_gaps, color=PALETTE[0])
    for bar, v in zip(bars, max_gaps):
        ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), f"{v:.2f} s", ha="center", va="bottom")
    ax.set_xlabel("prompt tokens per step (token budget)")
    ax.set_ylabel("longest gap between tokens (s)")
    rate = ax.twinx()
    rate.plot(labels, tokens_per_s, "o-", color=PALETTE[3])
    rate.set_ylabel("tokens per second (both requests)", color=PALETTE[3])
    rate.set_ylim(0, max(tokens_per_s) * 1.3)
    ax.set_title(title)
    return ax


def plot_serving_load(rates: list[float], figures: dict[str, list[float]], ax=None, ylabel: str = "p99 time between tokens (s)",
                      title: str = "The server under load"):
    """One line per configuration: a latency figure (for example p99 time between tokens) against the arrival rate."""
    ax = axes_or_new(ax, (6, 3))
    for i, (name, values) in enumerate(figures.items()):
        ax.plot(rates, values, "o-", color=PALETTE[i % len(PALETTE)], label=name)
    ax.set_xlabel("requests per second (Poisson arrivals)")
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0)
    ax.legend()
    ax.set_title(title)
    return ax


def plot_step_parts(record: dict, ax=None, title: str = "Where a decode step's milliseconds go, beside llama.cpp's"):
    """From a peers record's `profile` (measure.compiled.step_parts): per thread count, the compiled step split into
    its parts (stacked), llama.cpp's milliseconds per token below it (its own timer, then the rest of its gap), and
    a dashed tick at the weights' read floor (their bytes at the measured streaming rate; neither side can go under
    it). A part measured below zero (the rest, when the parts timed alone add up past the step) is drawn as zero."""
    llama_rows = {row["threads"]: row for row in record.get("rows", []) if row["path"] == "llama.cpp"}
    bars, floors = {}, []
    for p in record.get("profile", []):
        t = p["threads"]  # note: the parts in the record's order (measure.compiled.PARTS); "step" is their sum
        bars[f"{p['path']}, {t} thread(s)"] = {part.replace("_", " "): max(0.0, ms) for part, ms in p["ms"].items()
                                               if part != "step"}
        floors.append(p["read_floor_ms"])
        llama = llama_rows.get(t)
        if llama is not None:
            gap = 1000 / llama["decode_tokens_per_s"]
            own = llama.get("eval_ms_per_token")
            bars[f"llama.cpp, {t} thread(s)"] = ({"llama.cpp, its own timer": own, "llama.cpp, around its calls":
                                                  max(0.0, gap - own)} if own else {"llama.cpp, whole gap": gap})
            floors.append(p["read_floor_ms"])
    ax = axes_or_new(ax, (9, 0.6 * len(bars) + 1.6))
    groups = list(dict.fromkeys(g for b in bars.values() for g in b))
    left = [0.0] * len(bars)
    for i, group in enumerate(groups):
        widths = [b.get(group, 0.0) for b in bars.values()]
        ax.barh(list(bars), widths, left=left, label=group, color=PALETTE[i % len(PALETTE)])
        left = [a + w for a, w in zip(left, widths)]
    for i, floor in enumerate(floors):
        ax.plot([floor, floor], [i - 0.45, i + 0.45], color="black", linestyle="--",
                label="the weights' read floor" if i == 0 else None)
    ax.invert_yaxis()
    ax.set_xlabel("ms per token, one row, greedy")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    ax.set_title(title)
    return ax


def plot_paired_ratios(record: dict, ax=None, title: str = "The course's decode over llama.cpp's, pair by pair"):
    """From a paired peers record (measure.peers_protocol): per (file, threads) cell, each pair's ratio as a dot, the
    median as a bar with its bootstrap 95% interval, and the line at 1 (above it the course is faster)."""
    cells = record["cells"]
    ax = axes_or_new(ax, (9, 0.55 * len(cells) + 1.6))
    for i, cell in enumerate(cells):
        r = cell["paired_ratio"]
        ax.scatter(r["ratios"], [i] * len(r["ratios"]), color=PALETTE[0], alpha=0.5, s=14,
                   label="one pair" if i == 0 else None)
        ax.plot(r["ci95"], [i, i], color="black", linewidth=3, label="95% interval of the median" if i == 0 else None)
        ax.plot([r["median"]] * 2, [i - 0.3, i + 0.3], color=PALETTE[3], linewidth=2, label="median" if i == 0 else None)
    ax.axvline(1.0, color="gray", linestyle="--")
    ax.set_yticks(range(len(cells)), [f"{c['file']}, {c['threads']} thread(s), vs {c['llama_counted']}" for c in cells])
    ax.invert_yaxis()
    ax.set_xlabel("course tokens/s / llama.cpp tokens/s, same pair (above 1: the course is faster)")
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title(title)
    return ax


def plot_rows_cost(cost: dict, ax=None, title: str = "One 4-bit layer: cost per call against rows"):
    """measure.fast_path.rows_cost's curves (two, or three with the course's kernel): microseconds per call against the rows in the call, log-log, with
    the line a kernel would follow if each row cost as much as one."""
    ax = axes_or_new(ax, (6, 3))
    rows = cost["rows"]
    for i, (key, label) in enumerate((("int4_us", "4-bit kernel (torch)"), ("int8_us", "int8 copy, integer product"),
                                      ("course_us", "the course's 4-bit kernel (int4-q8)"))):
        if key in cost:
            ax.plot(rows, cost[key], "o-", color=PALETTE[i], label=label)
    ax.plot(rows, [cost["int4_us"][0] * r / rows[0] for r in rows], ":", color="grey",
            label="4-bit, each row as dear as one")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("rows in one call (decode: the batch; prefill: the prompt's tokens)")
    ax.set_ylabel("microseconds per call")
    ax.legend(fontsize=8)
    ax.set_title(title)
    return ax
