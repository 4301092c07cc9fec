"""Measurements of prefill, decode and memory bandwidth, and the course's benchmark command.

What it does: times prefill against prompt length and decode against context length; measures the
machine's memory bandwidth (a large tensor copy) to compare with the bandwidth decode achieves
reading the weights; and `run()` gathers the course's speed targets as ratios measured in one run
(our loop against model.generate, cache against no cache, widget redraws), for
`python -m course_lib bench`, which prints a table and writes JSON and PNG files.
Part II's sections (lessons 11-15) live in bench_part2; this module runs every section, reports targets
and saves the files.
What it does not do: assert anything (targets are reported, not tested) or use a GPU it is not given.
"""
from __future__ import annotations

import json
import platform
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from .attention import attention_section
from .long_context import long_context_report, long_context_section, long_context_targets
from .bench_part2 import (engine_section, formats_section, paged_section, serving_load_section, speculative_section,
                          structured_section)
from ..context import filler_ids, story_ids
from ..generation import decode_step, prefill
from .speed import cached_run, uncached_run
from .timers import TIMING_TOKEN, median
from ..runtime import describe_device, time_it

def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


@torch.inference_mode()
def prefill_timings(model, tokenizer, lengths: list[int], repeats: int = 3) -> list:
    """Every repeat of a prefill of each length (runtime.Timing: best, median, all the seconds), for plots that
    show the spread."""
    return [time_it(lambda n=n: prefill(model, filler_ids(tokenizer, n)), model.device, repeats=repeats)
            for n in lengths]


def prefill_seconds(model, tokenizer, lengths: list[int], repeats: int = 3) -> list[float]:
    """Best time to prefill a prompt of each length (time to first token, less the pick)."""
    return [t.best for t in prefill_timings(model, tokenizer, lengths, repeats)]


@torch.inference_mode()
def decode_timings(model, tokenizer, contexts: list[int], steps: int = 8) -> list:
    """Every decode step's seconds once the cache holds `context` tokens (runtime.Timing per context), after one
    warm-up step."""
    out = []
    for n in contexts:
        _, cache = prefill(model, filler_ids(tokenizer, n))
        out.append(time_it(lambda cache=cache: decode_step(model, [TIMING_TOKEN], cache), model.device,
                           repeats=steps, warmup=1))
    return out


def decode_seconds(model, tokenizer, contexts: list[int], steps: int = 8) -> list[float]:
    """Mean time of one decode step once the cache holds `context` tokens."""
    return [t.mean for t in decode_timings(model, tokenizer, contexts, steps)]


def memory_bandwidth(device: torch.device | str = "cpu", megabytes: int | None = None, repeats: int = 3) -> float:
    """Bytes per second this machine streams from memory, measured the way decode reads weights: a sum over a
    buffer far larger than the caches (measure.memory.read_bandwidth, sized by roofline.probe_bytes; lessons 08 and
    12 use the same ceiling)."""
    from .memory import read_bandwidth
    return read_bandwidth(megabytes, repeats, device)


def loop_vs_generate(model, tokenizer, prompt_ids: list[int], n_new: int, repeats: int = 3) -> dict:
    """Tokens per second of generation.generate (the loop learners call) and of model.generate, both making
    exactly n_new greedy tokens. Warmed up, timed alternately, best of `repeats`."""
    from .race import race
    r = race(model, model, tokenizer, prompt_ids, n_new, repeats)
    return {"tokens": n_new, "same_tokens": r["same_tokens"], "loop_tokens_per_s": r["tokens_per_s"],
            "generate_tokens_per_s": r["generate_tokens_per_s"], "ratio": r["ratio"]}


def cache_ratios(model, tokenizer, prompt_ids: list[int], lengths: list[int]) -> list[dict]:
    """Time without the KV cache divided by time with it, for several numbers of new tokens.
    After a warm-up, the cached run (seconds long) is timed twice and the best kept; the uncached run
    (up to a minute) once, which already averages over many steps."""
    cached_run(model, tokenizer, prompt_ids, 4)  # warm-up
    rows = []
    for n in lengths:
        with_cache = min((cached_run(model, tokenizer, prompt_ids, n) for _ in range(2)), key=lambda r: r.total)
        without = uncached_run(model, prompt_ids, n)
        rows.append({"new_tokens": n, "cached_s": with_cache.total, "uncached_s": without.total,
                     "ratio": without.total / with_cache.total, "same_tokens": with_cache.token_ids == without.token_ids,
                     "positions_cached": with_cache.positions_processed, "positions_uncached": without.positions_processed})
    return rows


def _load_section(model, tokenizer, quick):
    from ..loading import time_cached_load
    return {"load_seconds": time_cached_load(str(model.device), str(model.dtype).split(".")[-1])}


def _decode_section(model, tokenizer, quick):
    contexts = [16, 256] if quick else [16, 256, 1024, 4096]
    step = decode_seconds(model, tokenizer, contexts)
    bandwidth = memory_bandwidth(model.device, 128 if quick else None)
    achieved = weight_bytes(model) / step[0]
    from .roofline import compute_ceiling, probe_bytes
    peak = compute_ceiling(model.dtype, 512 if quick else 2048, device=model.device)
    return {"decode": [{"context": c, "seconds_per_token": s} for c, s in zip(contexts, step)],
            "bandwidth": {"weight_bytes": weight_bytes(model), "measured_read_bytes_per_s": bandwidth,
                          "probe_bytes": 128 * 2**20 if quick else probe_bytes(),
                          "decode_achieved_bytes_per_s": achieved, "utilisation": achieved / bandwidth,
                          "matmul_flops_per_s": peak, "ridge_flops_per_byte": peak / bandwidth}}


def _prefill_section(model, tokenizer, quick):
    lengths = [16, 64] if quick else [16, 64, 256, 1024]
    seconds = prefill_seconds(model, tokenizer, lengths)
    return {"prefill": [{"tokens": n, "seconds": s, "tokens_per_s": n / s} for n, s in zip(lengths, seconds)]}


def detokenize_ms_per_token(tokenizer, n: int, last: int = 100) -> float:
    """Milliseconds per token of the streaming detokenizer plus a stop-string check, over the last `last` of
    n tokens of real text (constant per token if the decoder only decodes a short window)."""
    from ..generation import Stopper
    ids = filler_ids(tokenizer, n)
    stopper = Stopper(tokenizer, set(), n + 1, n + 1, stop_strings=["THE END"])
    for token in ids[:-last]:
        stopper.update(token)
    start = time.perf_counter()
    for token in ids[-last:]:
        stopper.update(token)
    return 1000 * (time.perf_counter() - start) / last


def _widgets_section(model, tokenizer):
    """Milliseconds of what each widget runs when a control moves (the same html_views functions its observers
    call; ipywidgets itself is not needed): the sampling explorer over one set of logits, the attention
    explorer over (L, H, T, T) weights, the tokenizer box after a pasted book. Medians where repeated."""
    from ..forward import forward_logits
    from ..html_views import attention_table, sampling_view, tokenizer_comparison
    from ..sampling import SamplingConfig
    logits = forward_logits(model, story_ids(tokenizer))[0, -1].cpu()
    labels = {i: tokenizer.decode([i]) for i in torch.topk(logits, 60).indices.tolist()}
    sampling = []
    for t in [0.2, 0.5, 0.8, 1.1, 1.4, 1.7, 2.0]:
        start = time.perf_counter()
        sampling_view(logits, labels, SamplingConfig(temperature=t))
        sampling.append((time.perf_counter() - start) * 1000)
    weights, attention = torch.rand(30, 9, 12, 12).tril(), []
    for layer in range(1, 8):
        start = time.perf_counter()
        attention_table(weights[layer, 0].tolist(), [f"t{i}" for i in range(12)], f"layer {layer}, head 0")
        attention.append((time.perf_counter() - start) * 1000)
    text = ("The bank is closed because they had no money left. Crème brûlée in 東京 🍮. " * 2858)[:200_000]
    start = time.perf_counter()
    tokenizer_comparison(tokenizer, text)
    return {"sampling_explorer_ms": median(sampling), "attention_explorer_ms": median(attention),
            "tokenizer_box_200k_chars_ms": (time.perf_counter() - start) * 1000}


# Each section returns a dict merged into the result; its keys are the JSON keys the issues name.
SECTIONS = {
    "load": ("cached model load", _load_section),
    "loop_vs_generate": ("generation.generate against model.generate", lambda m, t, q: {
        "loop_vs_generate": loop_vs_generate(m, t, story_ids(t), 8 if q else 128)}),
    "cache": ("with and without the KV cache", lambda m, t, q: {
        "cache": cache_ratios(m, t, story_ids(t), [4, 8] if q else [32, 128, 256])}),
    "prefill": ("prefill against prompt length", _prefill_section),
    "decode": ("decode against context length, and memory bandwidth", _decode_section),
    "widgets": ("widget redraws", lambda m, t, q: {"widgets": _widgets_section(m, t)}),
    "detokenize": ("streaming detokenizer cost per token", lambda m, t, q: {"detokenize": {
        "ms_per_token_at_100": detokenize_ms_per_token(t, 100),
        "ms_per_token_at_8000": detokenize_ms_per_token(t, 1000 if q else 8000)}}),
    "engine": ("lesson 11: our model against the library", lambda m, t, q: {"engine": engine_section(m, t, q)}),
    "formats": ("lesson 12: weight formats, speed and quality", lambda m, t, q: {"formats": formats_section(m, t, q)}),
    "speculative": ("lesson 14: speculative decoding", lambda m, t, q: {"speculative": speculative_section(m, t, q)}),
    "paged": ("lesson 13: paged KV cache, prefix caching, preemption", lambda m, t, q: {"paged": paged_section(m, t, q)}),
    "structured": ("lesson 15: structured output", lambda m, t, q: {"structured": structured_section(m, t, q)}),
    "serving_load": ("lessons 10 and 13: the server under a mixed Poisson load",
                     lambda m, t, q: {"serving_load": serving_load_section(m, t, q)}),
    "attention": ("lesson 16: tiled attention, paged decode attention against the gather",
                  lambda m, t, q: {"attention": attention_section(m, t, q)}),
    "long_context": ("lesson 17: cache bytes, the end of the window, a quantized cache, the needle",
                     lambda m, t, q: {"long_context": long_context_section(m, t, q)}),
}


def parse_only(only: str | None) -> list[str]:
    """'engine,cache' -> ['engine', 'cache']; None -> every section. Unknown names are an error that lists them all."""
    if not only:
        return list(SECTIONS)
    names = [n.strip() for n in only.split(",") if n.strip()]
    unknown = [n for n in names if n not in SECTIONS]
    if unknown or not names:
        raise ValueError(f"unknown bench section(s) {unknown or only!r}: choose from {', '.join(SECTIONS)}")
    return names


def run(model, tokenizer, quick: bool = False, only: str | None = None, progress: bool | None = None) -> dict:
    """The benchmark's sections (all, or those named in `only`), in one run on one device.
    quick: tiny sizes (for tests). progress: a bar over sections (default: only when stderr is a terminal)."""
    import sys
    from tqdm.auto import tqdm
    names = parse_only(only)
    result = {"when": datetime.now(timezone.utc).isoformat(timespec="seconds"), "host": platform.node(),
              "machine": describe_device(model.device), "dtype": str(model.dtype).split(".")[-1], "quick": quick,
              "threads": torch.get_num_threads(), "sections": names}
    show = sys.stderr.isatty() if progress is None else progress
    bar = tqdm(names, desc="bench", disable=not show, unit="section")
    for name in bar:
        label, fn = SECTIONS[name]
        bar.set_postfix_str(label)
        if not show and progress is None:
            print(f"measuring: {label}", flush=True)
        result.update(fn(model, tokenizer, quick))
    return result


def targets(result: dict) -> list[tuple[str, str, bool]]:
    """The course's speed targets for the sections that ran, as (what, measured, met)."""
    out = []
    if "loop_vs_generate" in result:
        lvg = result["loop_vs_generate"]
        out.append(("generation.generate at least as fast as model.generate",
                    f"{lvg['ratio']:.2f}x (same tokens: {lvg['same_tokens']})", lvg["ratio"] >= 1.0 and lvg["same_tokens"]))
    if "cache" in result:
        cache_256 = next((r for r in result["cache"] if r["new_tokens"] == 256), result["cache"][-1])
        out.append((f"cache at least 5x faster than no cache at {cache_256['new_tokens']} new tokens",
                    f"{cache_256['ratio']:.1f}x", cache_256["ratio"] >= 5.0))
    if "load_seconds" in result:
        out.append(("cached model load about a second", f"{result['load_seconds']:.2f} s", result["load_seconds"] < 2.0))
    if "widgets" in result:
        w = result["widgets"]
        out.append(("sampling explorer redraw well under 100 ms", f"{w['sampling_explorer_ms']:.1f} ms",
                    w["sampling_explorer_ms"] < 100))
        out.append(("attention explorer redraw well under 100 ms", f"{w['attention_explorer_ms']:.1f} ms",
                    w["attention_explorer_ms"] < 100))
    if "detokenize" in result:
        d = result["detokenize"]
        long_key = "ms_per_token_at_8000"
        out.append(("detokenizer: a token costs the same at 8,000 tokens as at 100 (within 2x)",
                    f"{d['ms_per_token_at_100']:.3f} vs {d[long_key]:.3f} ms", d[long_key] < 2 * d["ms_per_token_at_100"]))
    if "engine" in result:
        e = result["engine"]
        out.append(("engine: same tokens as model.generate, at least as fast",
                    f"{e['ratio']:.2f}x (same tokens: {e['same_tokens']})", e["ratio"] >= 1.0 and e["same_tokens"]))
        out.append((f"engine: at least 1.3x faster decode after {e['long_context_tokens']} tokens",
                    f"{e['long_context_ratio']:.2f}x", e["long_context_ratio"] >= 1.3))
    if "speculative" in result:
        rows = result["speculative"]
        out.append(("speculative: same tokens as plain greedy everywhere", f"{sum(r['same_tokens'] for r in rows)} of {len(rows)}",
                    all(r["same_tokens"] for r in rows)))
        lookup = next(r for r in rows if r["drafter"] == "prompt_lookup" and r["task"] == "grounded_edit")
        out.append(("speculative: prompt lookup at least 1.5x on the grounded edit", f"{lookup['speedup']:.2f}x",
                    lookup["speedup"] >= 1.5))
        story = max((r for r in rows if r["task"] == "story"), key=lambda r: r["speedup"])
        out.append((f"speculative: best drafter on free writing ({story['drafter']}) faster than none",
                    f"{story['speedup']:.2f}x", story["speedup"] > 1.0))
    if "structured" in result:
        st = result["structured"]
        out.append(("structured: every constrained answer valid", f"{st['valid_constrained']:.0%} (free: {st['valid_free']:.0%})",
                    st["valid_constrained"] == 1.0))
        out.append(("structured: the engine's mask under a tenth of a decode step",
                    f"{st['mask_ms_per_token']:.2f} vs {st['decode_ms_per_token']:.1f} ms", st["mask_ms_per_token"] < st["decode_ms_per_token"] / 10))
    if "paged" in result:
        p = result["paged"]
        out.append(("paged: same tokens as the contiguous cache (alone, batched, prefix hits, preempted)",
                    str(p["same_tokens"]), p["same_tokens"]))
        out.append(("paged: at most half the bytes of the contiguous cache on the trace",
                    f"{p['kv_bytes_paged'] / 1e6:.0f} vs {p['kv_bytes_contiguous'] / 1e6:.0f} MB",
                    p["kv_bytes_paged"] <= 0.5 * p["kv_bytes_contiguous"]))
        out.append((f"paged: a {p['prefix_tokens']}-token prefix hit cuts time to first token at least 3x",
                    f"{p['prefix_ttft_ratio']:.1f}x", p["prefix_ttft_ratio"] >= 3.0))
    if "serving_load" in result:
        s = result["serving_load"]
        whole, chunked = s["itl_p99_s"]["paged"][-1], s["itl_p99_s"]["paged_chunked"][-1]
        tps_whole, tps_chunked = s["tokens_per_s"]["paged"][-1], s["tokens_per_s"]["paged_chunked"][-1]
        out.append(("serving: every request answered, each as alone (greedy)", str(s["same_answers"]), s["same_answers"]))
        out.append((f"serving: chunked prefill cuts p99 time between tokens at least 3x ({s['rates'][-1]} req/s)",
                    f"{whole:.2f} -> {chunked:.2f} s ({whole / chunked:.1f}x)", whole >= 3 * chunked))
        out.append(("serving: chunked prefill loses at most 10% throughput",
                    f"{tps_chunked:.1f} vs {tps_whole:.1f} tok/s", tps_chunked >= 0.9 * tps_whole))
    if "attention" in result:
        a = result["attention"]
        small, large = list(a["paged_speedup"])
        out.append(("attention: tiled and paged equal to SDPA and the gather on real tensors", str(a["same_output"]),
                    a["same_output"]))
        out.append((f"attention: paged decode no slower than the gather at {small}", f"{a['paged_speedup'][small]:.2f}x",
                    a["paged_speedup"][small] >= 1.0))
        out.append((f"attention: paged decode faster than the gather at {large}", f"{a['paged_speedup'][large]:.2f}x",
                    a["paged_speedup"][large] > 1.0))
        out.append((f"attention: paged step allocates less than the gather writes ({small})",
                    f"{a['step_peak_bytes'][small]['paged'] / 1e6:.1f} vs {a['gather_bytes_per_step'][small] / 1e6:.0f} MB",
                    a["step_peak_bytes"][small]["paged"] < a["gather_bytes_per_step"][small] / 10))
    if "long_context" in result:
        out += long_context_targets(result["long_context"])
    if "formats" in result:
        f = result["formats"]["fastest"]
        out.append((f"formats: fastest ({f['name']}) at least 3.5x model.generate, top-1 agreement >= 0.9",
                    f"{f['ratio_to_generate']:.2f}x, agreement {f['top1_agreement']:.2f}",
                    f["ratio_to_generate"] >= 3.5 and f["top1_agreement"] >= 0.9))
    return out


def format_report(result: dict) -> str:
    m = result["machine"]
    lines = [f"benchmark on {m['name']} ({m['device']}, {result['dtype']}, {result.get('threads', '?')} threads), "
             f"{result['when']}", ""]
    if "loop_vs_generate" in result:
        lvg = result["loop_vs_generate"]
        lines.append(f"generation.generate {lvg['loop_tokens_per_s']:.1f} tok/s | model.generate "
                     f"{lvg['generate_tokens_per_s']:.1f} tok/s")
    for r in result.get("cache", []):
        lines.append(f"{r['new_tokens']:>4} new tokens: cache {r['cached_s']:.2f} s, no cache {r['uncached_s']:.2f} s "
                     f"-> {r['ratio']:.1f}x; positions {r['positions_cached']} vs {r['positions_uncached']}")
    if "prefill" in result:
        lines.append("prefill: " + ", ".join(f"{p['tokens']} tok {p['tokens_per_s']:.0f} tok/s" for p in result["prefill"]))
    if "decode" in result:
        lines.append("decode:  " + ", ".join(f"ctx {d['context']} {d['seconds_per_token'] * 1000:.1f} ms/tok"
                                             for d in result["decode"]))
        bw = result["bandwidth"]
        lines.append(f"bandwidth: streaming read {bw['measured_read_bytes_per_s'] / 1e9:.1f} GB/s, decode reads weights at "
                     f"{bw['decode_achieved_bytes_per_s'] / 1e9:.1f} GB/s -> utilisation {bw['utilisation']:.0%}"
                     + (f"; matrix product {bw['matmul_flops_per_s'] / 1e9:.0f} GFLOP/s, ridge {bw['ridge_flops_per_byte']:.1f} "
                        "FLOP/byte" if "matmul_flops_per_s" in bw else ""))
    if "engine" in result:
        e = result["engine"]
        lines.append(f"engine: ours {e['tokens_per_s']:.1f} tok/s vs model.generate {e['generate_tokens_per_s']:.1f} "
                     f"({e['ratio']:.2f}x), reading weights at {e['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s; after "
                     f"{e['long_context_tokens']} tokens {e['long_context_ms_per_token']:.1f} vs "
                     f"{e['long_context_generate_ms_per_token']:.1f} ms/token ({e['long_context_ratio']:.2f}x)")
        by_columns = [name for name, layout in e["layouts"].items() if layout == "columns"] or ["none"]
        for fmt, a in e.get("ops_per_step", {}).items():
            lines.append(f"engine step ({fmt}, batch 1): {a['step_ms']:.1f} ms = matrix products alone {a['products_ms']:.1f} "
                         f"+ the rest {a['rest_ms']:.1f}; {a['aten_ops']:.0f} operators counted by the profiler, "
                         f"{a['python_calls']:.0f} called from Python (about {a['calling_ms_estimate']:.1f} ms to call "
                         f"at {a['tiny_call_us']:.2f} us each)")
        c = e.get("compiled")
        for fmt, row in (c or {}).get("formats", {}).items():
            compiled = (f"compiled {row['compiled_ms']:.1f} ms ({row['speedup']:.2f}x the engine's step; "
                        f"{row['compiled_ops_per_step']:.0f} operators against {row['static_eager_ops_per_step']:.0f} "
                        f"eagerly; compiling took {row['compile_s']:.0f} s; same tokens: {row['compiled_same_tokens']})"
                        if c["compiled"]
                        else f"not compiled: {c['why_not']}")
            lines.append(f"engine static step ({fmt}): engine {row['engine_ms']:.1f} ms, static eager "
                         f"{row['static_eager_ms']:.1f} ms, {compiled}")
        lines.append(f"engine layout: by columns {', '.join(by_columns)}; a step {e['built_step_ms']:.1f} ms as built, "
                     f"{e['rows_step_ms']:.1f} ms all by rows ({e['layout_speedup']:.2f}x); several rows through oneDNN: "
                     f"{', '.join(n for n, k in e['several_rows_kernels'].items() if k == 'onednn') or 'none'}")
    if "formats" in result:
        f = result["formats"]
        lines.append(f"formats (decode, median gap; model.generate {f['generate_tokens_per_s']:.1f} tok/s; "
                     f"read ceiling {f['read_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s):")
        lines += [f"  {r['name']:<13} {r['weight_bytes'] / 1e6:6.1f} MB/token {r['tokens_per_s']:6.1f} tok/s "
                  f"{r['bandwidth_bytes_per_s'] / 1e9:5.1f} GB/s  top-1 {r['top1_agreement']:.3f}  KL {r['kl']:.4f}"
                  for r in f["formats"]]
    for r in result.get("speculative", []):
        lines.append(f"speculative {r['drafter']:<14} {r['task']:<14} k={r['k']} accepted {r['acceptance_rate']:.2f} "
                     f"{r['tokens_per_verify']:.2f} tok/verify {r['tokens_per_s']:5.1f} vs {r['baseline_tokens_per_s']:5.1f} "
                     f"tok/s -> {r['speedup']:.2f}x same={r['same_tokens']}")
    if "paged" in result:
        p = result["paged"]
        lines.append(f"paged: trace of {p['requests']} requests, peak KV {p['kv_bytes_paged'] / 1e6:.0f} MB paged vs "
                     f"{p['kv_bytes_contiguous'] / 1e6:.0f} MB contiguous; first token {p['ttft_no_prefix_s']:.3f} s -> "
                     f"{p['ttft_prefix_s']:.3f} s with a prefix hit ({p['prefix_ttft_ratio']:.1f}x, hit rate "
                     f"{p['prefix_hit_rate']:.2f}); {p['budget_blocks']} blocks: preempt finished {p['finished_preempt']} "
                     f"({p['preempted']} preemptions, {p['recomputed_tokens']} tokens recomputed), reject {p['finished_reject']}"
                     + (f", reserve-and-wait {p['finished_reserve']} in {p['seconds_reserve']:.1f} s against preempt's {p['seconds_preempt']:.1f} s" if 'finished_reserve' in p else ""))
    if "serving_load" in result:
        s = result["serving_load"]
        for name in s["configs"]:
            for i, rate in enumerate(s["rates"]):
                lines.append(f"serving {name:<14} {rate:.2f} req/s: first token p50 {s['ttft_p50_s'][name][i]:.2f} "
                             f"p99 {s['ttft_p99_s'][name][i]:.2f} s, between tokens p50 {s['itl_p50_s'][name][i]:.3f} "
                             f"p99 {s['itl_p99_s'][name][i]:.3f} s, {s['tokens_per_s'][name][i]:.1f} tok/s, goodput "
                             f"{s['goodput_rps'][name][i]:.3f} req/s, {s['finished'][name][i]} finished")
        g = s["max_decode_gap_s"]
        lines.append(f"serving: a running request's longest wait while a long prompt is read: {g['whole']:.2f} s whole, "
                     f"{g['chunked']:.2f} s chunked")
    if "attention" in result:
        a = result["attention"]
        for name in a["paged_step_ms"]:
            lines.append(f"attention {name}: decode step {a['paged_step_ms'][name]:.1f} ms through the tables, "
                         f"{a['gather_step_ms'][name]:.1f} ms gathered ({a['paged_speedup'][name]:.2f}x); the gather writes "
                         f"{a['gather_bytes_per_step'][name] / 1e6:.0f} MB per step; peak allocated "
                         f"{a['step_peak_bytes'][name]['paged'] / 1e6:.1f} vs {a['step_peak_bytes'][name]['gather'] / 1e6:.1f} MB")
        lines.append("attention block sizes: " + ", ".join(f"{b['block_size']}: {b['paged_ms']:.1f} vs {b['gather_ms']:.1f} ms"
                                                           for b in a["block_sizes"]))
        t = a["lesson13_trace"]
        lines.append(f"attention on lesson 13's trace: {t['tokens_per_s']['paged']:.1f} tok/s through the tables, "
                     f"{t['tokens_per_s']['gather']:.1f} gathered (same tokens: {t['same_tokens']})")
        lines.append(f"attention prefill of {a['prefill_tokens']} tokens, one layer, peak allocated: written out "
                     f"{a['naive_peak_bytes'] / 1e6:.0f} MB, tiled {a['tiled_peak_bytes'] / 1e6:.1f} MB, SDPA "
                     f"{a['sdpa_peak_bytes'] / 1e6:.1f} MB")
    if "long_context" in result:
        lines += long_context_report(result["long_context"])
    lines += ["", f"{'target':<60} {'measured':<28} met"]
    lines += [f"{what:<60} {measured:<28} {'yes' if met else 'NO'}" for what, measured, met in targets(result)]
    return "\n".join(lines)


def save(result: dict, folder: Path) -> list[Path]:
    """Write the result JSON, and a PNG of the prefill and decode curves when those sections ran, into folder.
    The figure is drawn on its own canvas: the caller's matplotlib backend is left alone."""
    folder.mkdir(parents=True, exist_ok=True)
    name = f"bench-{result['machine']['device'].split(':')[0]}-{result['when'][:10]}"
    if result["sections"] != list(SECTIONS):
        name += "-" + "-".join(result["sections"])
    json_path = folder / f"{name}.json"
    json_path.write_text(json.dumps(result, indent=2))
    paths = [json_path]
    if "prefill" in result and "decode" in result:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from .. import plots_perf
        fig = plots_perf.plot_benchmark(result)
        FigureCanvasAgg(fig).print_png(str(folder / f"{name}.png"))
        import matplotlib.pyplot as plt
        plt.close(fig)
        paths.append(folder / f"{name}.png")
    return paths
