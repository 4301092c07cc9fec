"""A comparison with llama.cpp that cannot flatter either side (issue: the fast path is the engine, item 4).

What it does: one trial is one fresh process for one engine (the course's compiled int4 step, or llama.cpp with flash
attention off or on), one GGUF file, one thread count and one context, pinned to its cores with taskset; trials run in
pairs whose order turns each pair, so a drift of the machine lands on both sides alike; each side times the whole
greedy loop with its argmax (measure.timers.greedy_gaps; peers_llama.llama_decode). `paired_summary` gives the median of
the per-pair ratios, a bootstrap 95% interval and the range; `machine_state` records the load average, the steal time
and each core's MHz before and after a sitting. `course_trial` and `course_quality` are what the course's child process
runs (scripts/peers_cpu.py): the compiled step's own tokens per second, and its own perplexity and KL to float32 on a
text, token by token through the compiled step.
What it does not do: build llama.cpp (a scratch environment: scripts/peers_cpu.py says how), or decide anything.
"""
from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path

from ..runtime import median

ROOT = Path(__file__).resolve().parents[2]
LLAMA_CONFIGS = ("llama.cpp", "llama.cpp flash")  # flash attention off, on: the faster one is counted


def cores(threads: int) -> str:
    """The cores a trial at `threads` is pinned to (taskset's list): the first `threads` of the machine."""
    import os
    have = sorted(os.sched_getaffinity(0))
    if not isinstance(threads, int) or not 1 <= threads <= len(have):
        raise ValueError(f"threads must be 1..{len(have)} (the cores this process may use), got {threads!r}")
    return ",".join(str(c) for c in have[:threads])


def machine_state() -> dict:
    """What could move a sitting's figures, read from Linux: load average, the CPU time counters (steal included,
    in clock ticks) and each core's MHz. Empty fields where /proc does not have them."""
    def read(path):
        try:
            return Path(path).read_text()
        except OSError:
            return ""
    stat = read("/proc/stat").splitlines()
    names = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
    ticks = dict(zip(names, (int(x) for x in stat[0].split()[1:9]))) if stat and stat[0].startswith("cpu ") else {}
    mhz = [float(line.split(":")[1]) for line in read("/proc/cpuinfo").splitlines() if line.startswith("cpu MHz")]
    load = read("/proc/loadavg").split()[:3]
    return {"time": time.time(), "loadavg": [float(x) for x in load], "ticks": ticks, "cpu_mhz": mhz}


def steal_fraction(before: dict, after: dict) -> float | None:
    """The share of CPU time the hypervisor took from this machine between two machine_state readings."""
    a, b = before.get("ticks") or {}, after.get("ticks") or {}
    if not a or not b:
        return None
    total = sum(b.values()) - sum(a.values())
    return (b["steal"] - a["steal"]) / total if total > 0 else 0.0


def bootstrap_median_ci(values: list[float], resamples: int = 10_000, seed: int = 0) -> tuple[float, float]:
    """The 2.5th and 97.5th percentiles of the median of `values` resampled with replacement (seeded)."""
    if not values:
        raise ValueError("no values to resample")
    rng = random.Random(seed)
    medians = sorted(median([rng.choice(values) for _ in values]) for _ in range(resamples))
    return medians[int(0.025 * (resamples - 1))], medians[int(0.975 * (resamples - 1))]


def paired_summary(ours: list[float], theirs: list[float], seed: int = 0) -> dict:
    """Per-pair ratios ours[i] / theirs[i] (tokens per second, so above 1 means the course is faster): their median,
    a bootstrap 95% interval of that median, min and max, and the ratios themselves."""
    if len(ours) != len(theirs) or not ours:
        raise ValueError(f"paired figures need the same positive number on each side, got {len(ours)} and {len(theirs)}")
    ratios = [a / b for a, b in zip(ours, theirs)]
    return {"median": median(ratios), "ci95": list(bootstrap_median_ci(ratios, seed=seed)), "min": min(ratios),
            "max": max(ratios), "pairs": len(ratios), "ratios": ratios}


def pair_order(i: int, sides: tuple[str, ...]) -> list[str]:
    """The order of pair i's trials: the sides turned by one place each pair, so each side goes first in turn."""
    k = i % len(sides)
    return list(sides[k:] + sides[:k])


def run_child(command: list[str], threads: int, timeout: float = 900) -> dict:
    """One trial: `command` in a fresh process pinned to cores(threads); the JSON object its last line prints."""
    pinned = ["taskset", "-c", cores(threads), *command]
    proc = subprocess.run(pinned, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"trial failed ({' '.join(command[:3])}...): {proc.stderr.strip()[-800:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def course_format(file_name: str, four_bit: str = "int4") -> str:
    """The course's weight format that matches a GGUF file's: int8 for an 8-bit file (Q8_0), else `four_bit`
    (int4: torch's 4-bit kernel; int4-q8: the course's own, runner/q4_kernel.py)."""
    if four_bit not in ("int4", "int4-q8"):
        raise ValueError(f"the course's 4-bit side is 'int4' or 'int4-q8', not {four_bit!r}")
    return "int8" if "Q8" in file_name.upper() else four_bit


def trial_commands(gguf: str, threads: int, context: int, ids_file: str, llama_python: str,
                   fmt: str = "int4", step: str = "compiled") -> dict[str, list[str]]:
    """The command of each side's trial: the course's step (`step`: compiled by torch.compile, or fused: one C++ call,
    int4-q8 only) in `fmt` (scripts/peers_cpu.py trial), llama.cpp with flash attention off and on (peers_llama.py
    decode), on the same file, IDs, threads and context."""
    script = str(Path(__file__).with_name("peers_llama.py"))
    llama = [llama_python, script, "decode", ids_file, gguf, str(threads), str(context)]
    return {f"course {fmt} {step}": [sys.executable, str(ROOT / "scripts" / "peers_cpu.py"), "trial", "--gguf", gguf,
                                     "--threads", str(threads), "--context", str(context), "--ids", ids_file,
                                     "--fmt", fmt, "--step", step],
            "llama.cpp": llama + ["0"], "llama.cpp flash": llama + ["1"]}


def sitting(files: dict[str, str], threads=(1, 2), context: int = 1024, pairs: int = 10, ids_file: str = "",
            llama_python: str = sys.executable, run=run_child, progress=print, save=None, four_bit: str = "int4",
            step: str = "compiled") -> dict:
    """Every file at every thread count: `pairs` rounds of the three trials (course, llama.cpp without and with flash
    attention) in turning order, the machine's state before and after each (file, threads). Returns the raw trials and,
    per (file, threads), the paired summary against llama.cpp's faster configuration (by its median rate). `save`,
    when given, is called with the record after each cell (a long sitting cut short keeps what it measured).
    `four_bit`: the course's format on a 4-bit file (course_format); `step`: the course's step (trial_commands)."""
    out = {"context": context, "pairs": pairs, "cells": []}
    for t in threads:
        for name, gguf in files.items():
            fmt = course_format(name, four_bit)
            commands = trial_commands(gguf, t, context, ids_file, llama_python, fmt, step_for(fmt, step))
            sides = tuple(commands)
            before, trials = machine_state(), {side: [] for side in sides}
            for i in range(pairs):
                for side in pair_order(i, sides):
                    trials[side].append(run(commands[side], t))
                progress(f"  {name} {t} thread(s) pair {i + 1}/{pairs}: " + ", ".join(
                    f"{side} {trials[side][-1]['loop_tokens_per_s']:.1f}" for side in sides))
            after = machine_state()
            out["cells"].append(cell_summary(name, t, trials, before, after))
            if save is not None:
                save(out)
    return out


def cell_summary(name: str, threads: int, trials: dict[str, list[dict]], before: dict, after: dict) -> dict:
    """One (file, threads) cell: each side's rates (the whole loop's tokens per second, and from its median gap),
    llama.cpp's faster configuration, the paired ratios against it, and the machine's state around the cell."""
    rate = lambda side, key="loop_tokens_per_s": [trial[key] for trial in trials[side]]  # noqa: E731
    course = next(side for side in trials if side.startswith("course"))
    llamas = [side for side in trials if side in LLAMA_CONFIGS]
    best = max(llamas, key=lambda side: median(rate(side)))
    return {"file": name, "threads": threads, "llama_counted": best,
            "paired_ratio": paired_summary(rate(course), rate(best)),
            "paired_ratio_median_gap": paired_summary(rate(course, "tokens_per_s"), rate(best, "tokens_per_s")),
            "rates": {side: {"loop": rate(side), "median_gap": rate(side, "tokens_per_s")} for side in trials},
            "compile_s": [trial.get("compile_s") for trial in trials[course]],
            "same_tokens": [trial["tokens"] == trials[best][i]["tokens"] for i, trial in enumerate(trials[course])],
            "llama": {k: trials[best][0].get(k) for k in ("system_info", "library_sha256", "llama_cpp_python")},
            "machine": {"before": before, "after": after, "steal_fraction": steal_fraction(before, after)}}


def course_trial(gguf: str, threads: int, context: int, ids: dict, fmt: str = "int4", step: str = "compiled") -> dict:
    """The course's side of one trial, in this (fresh) process: the model read from `gguf`, in format `fmt`, its
    decode step (`step`: 'compiled', or 'fused' as step_for allows) at a static capacity of `context` columns (what
    llama.cpp's n_ctx holds); a warm-up of 4 tokens (which compiles), then ids['n_new'] greedy tokens after the
    prompt, each gap timed with its argmax."""
    import torch
    from .timers import greedy_gaps
    torch.set_num_threads(threads)
    model = course_model(gguf, fmt)
    step = course_step(model, context, step)
    greedy_gaps(step, step.prefill(ids["prompt"]), 4, model.device)  # compiles
    tokens, gaps = greedy_gaps(step, step.prefill(ids["prompt"]), ids["n_new"], model.device)
    return {"tokens": tokens, "tokens_per_s": 1 / median(gaps), "loop_tokens_per_s": len(gaps) / sum(gaps),
            "compile_s": step.compile_seconds, "threads": torch.get_num_threads()}


def step_for(fmt: str, step: str) -> str:
    """The course's step on a file whose format is `fmt`: the fused step exists for int4-q8, and for int4 where the
    CPU has AVX-512 BF16 (fused_step.why_not_fused), so any other format (int8 on a Q8_0 file) keeps
    torch.compile's. Example: step_for("int8", "fused") -> 'compiled'"""
    if step != "fused" or fmt == "int4-q8":
        return step
    from ..runner import q4_kernel
    return step if fmt == "int4" and not q4_kernel.why_not_bf16() else "compiled"


def course_step(model, capacity: int, kind: str = "compiled"):
    """A StaticStep of `capacity` columns: 'compiled' (torch.compile, afresh) or 'fused' (one C++ call a step)."""
    from .compiled import fresh_compiled_step
    from ..runner.static_step import StaticStep
    if kind not in ("compiled", "fused"):
        raise ValueError(f"the course's step is 'compiled' or 'fused', not {kind!r}")
    return fresh_compiled_step(model, capacity) if kind == "compiled" else StaticStep(model, capacity, fused=True)


def course_model(gguf: str, fmt: str = "int4"):
    """The course's model from a GGUF file in format `fmt`: the bundled file from the course's weight cache, any other
    through transformers' GGUF reader (which dequantizes it), then converted (int4: groups of 32, as the blocks)."""
    from ..loading import gguf_path, load_model
    from ..runner.formats import convert
    from ..runner.model import Model
    name = None if Path(gguf).resolve() == gguf_path().resolve() else gguf
    model, _ = load_model(name, device="cpu", dtype="float32", verbose=False)
    return convert(Model.from_transformers(model), fmt)


def course_quality(gguf: str, text: list[int], threads: int = 2, fmt: str = "int4", step: str = "compiled") -> dict:
    """The course's step's own quality on `text` (`step`: course_step's kind): each token fed through the step in
    turn (teacher forcing), perplexity from its logits and the mean KL(float32 model || the step) per position, the float32
    model being the course's bundled weights in one ordinary pass."""
    import torch
    from .quality import log_probs
    from ..loading import load_model
    from ..runner.model import Model
    torch.set_num_threads(threads)
    reference, _ = load_model(device="cpu", dtype="float32", verbose=False)
    ref = log_probs(Model.from_transformers(reference), text)[:-1]  # (T-1, V)
    step = course_step(course_model(gguf, fmt), len(text) + 1, step)
    logits = step.prefill(text[:1])
    nll = kl = 0.0
    with torch.inference_mode():
        for i in range(1, len(text)):
            lp = torch.log_softmax(logits.float(), dim=-1)
            nll -= float(lp[text[i]])
            kl += float((ref[i - 1].exp() * (ref[i - 1] - lp)).sum())
            logits = step(text[i])
    n = len(text) - 1
    return {"perplexity": float(torch.tensor(nll / n).exp()), "kl_to_float32": kl / n, "tokens": len(text)}


def paired_records(folder: Path) -> list[Path]:
    """The paired records at a 1,024 context in `folder` (peers-paired-cpu-DATE[-HHMM].json), oldest sitting first
    (by the time each record says it ended; a second sitting on one day carries its hour in the name)."""
    files = [p for p in folder.glob("peers-paired-cpu-*.json") if "-context" not in p.name]
    return sorted(files, key=lambda p: json.loads(p.read_text())["when"])


def describe(record: dict) -> list[str]:
    """A paired record as lines: per file and thread count, each side's median rate, the paired ratio against
    llama.cpp's faster configuration with its interval and range, the machine around it; then each file's quality."""
    lines = [f"paired protocol: {record['pairs']} pairs per cell, context {record['context']}, a fresh pinned process "
             "per trial, order turning each pair, the whole greedy loop timed with its argmax on both sides"]
    for cell in record["cells"]:
        r, m = cell["paired_ratio"], cell["machine"]
        rates = ", ".join(f"{side} {median(v['loop']):.1f}" for side, v in cell["rates"].items())
        steal = "?" if m["steal_fraction"] is None else f"{100 * m['steal_fraction']:.1f}%"
        lines.append(f"  {cell['file']} {cell['threads']} thread(s): {rates} tok/s (medians); course / "
                     f"{cell['llama_counted']} {r['median']:.2f}x (95% {r['ci95'][0]:.2f}-{r['ci95'][1]:.2f}, range "
                     f"{r['min']:.2f}-{r['max']:.2f}); load {m['before']['loadavg'][0]:.2f} -> {m['after']['loadavg'][0]:.2f}, "
                     f"steal {steal}; {verdict(r['ci95'])}")
    step = record.get("course_step", "compiled")  # the course's step on its 4-bit files (older records: compiled)
    for name, q in record.get("quality", {}).items():
        ours, theirs = q["course_compiled"], q["llama.cpp"]  # note: the key predates the fused step; `step` names it
        lines.append(f"  {name} perplexity on {ours['tokens']} tokens: course {step} {ours['perplexity']:.3f} (KL to "
                     f"float32 {ours['kl_to_float32']:.4f} nats), llama.cpp {theirs['perplexity']:.3f} "
                     f"({100 * (ours['perplexity'] / theirs['perplexity'] - 1):+.1f}%)")
    return lines


def verdict(ci95) -> str:
    """What a cell's interval settles: which engine was faster when the whole interval is on one side of 1."""
    low, high = ci95
    return "the course faster" if low > 1 else "llama.cpp faster" if high < 1 else "settles nothing"


def describe_llama_bench(record: dict) -> list[str]:
    """A llama-bench record (scripts/peers_cpu.py llama-bench) as lines: per file, threads, flash attention and depth,
    llama.cpp's own mean generation rate over its repetitions, with its standard deviation."""
    lines = [f"llama-bench ({' '.join(record['flags'][:-2])}), llama.cpp's own timer, tokens/s (mean +- sd)"]
    for name, rows in record["rows"].items():
        for r in sorted(rows, key=lambda r: (r["n_threads"], r["n_depth"], r["flash_attn"])):
            lines.append(f"  {name} {r['n_threads']} thread(s), depth {r['n_depth']:>4}, flash attention "
                         f"{'on ' if r['flash_attn'] else 'off'}: {r['avg_ts']:6.1f} +- {r['stddev_ts']:.1f}")
    return lines
