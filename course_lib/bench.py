"""Measurements of prefill, decode and memory bandwidth, and the course's benchmark command.

What it does: times prefill against prompt length and decode against context length; measures the
machine's memory bandwidth (a large tensor copy) to compare with the bandwidth decode achieves
reading the weights; and `run()` gathers the course's speed targets as ratios measured in one run
(our loop against model.generate, cache against no cache, widget redraws), for
`python -m course_lib bench`, which prints a table and writes JSON and PNG files.
What it does not do: assert anything (targets are reported, not tested) or use a GPU it is not given.
"""
from __future__ import annotations

import json
import platform
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from .generation import decode_step, prefill
from .kv_cache import run_with_cache, run_without_cache
from .runtime import describe_device, synchronize, time_it

STORY = "Write a short story about a robot who learns to paint."


def story_ids(tokenizer) -> list[int]:
    """The course's long-answer prompt, through the chat template."""
    return tokenizer.apply_chat_template([{"role": "user", "content": STORY}], add_generation_prompt=True,
                                         return_dict=True)["input_ids"]


def filler_ids(tokenizer, n: int) -> list[int]:
    """n tokens of real text (the story prompt repeated), for length sweeps."""
    base = tokenizer(" Once upon a time, a small robot found a box of paints in an empty studio.",
                     add_special_tokens=False)["input_ids"]
    return (base * (n // len(base) + 1))[:n]


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


@torch.inference_mode()
def prefill_seconds(model, tokenizer, lengths: list[int], repeats: int = 3) -> list[float]:
    """Best time to prefill a prompt of each length (time to first token, less the pick)."""
    return [time_it(lambda n=n: prefill(model, filler_ids(tokenizer, n)), model.device, repeats=repeats).best
            for n in lengths]


@torch.inference_mode()
def decode_seconds(model, tokenizer, contexts: list[int], steps: int = 8) -> list[float]:
    """Mean time of one decode step once the cache holds `context` tokens."""
    out = []
    for n in contexts:
        _, cache = prefill(model, filler_ids(tokenizer, n))
        decode_step(model, [42], cache)  # warm-up step
        synchronize(model.device)
        start = time.perf_counter()
        for _ in range(steps):
            decode_step(model, [42], cache)
        synchronize(model.device)
        out.append((time.perf_counter() - start) / steps)
    return out


def memory_bandwidth(device: torch.device | str = "cpu", megabytes: int = 256, repeats: int = 5) -> float:
    """Bytes per second moved by copying a large tensor (each byte read once and written once)."""
    src = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    best = time_it(lambda: dst.copy_(src), device, repeats=repeats).best
    return 2 * src.numel() * 4 / best


def loop_vs_generate(model, prompt_ids: list[int], n_new: int, repeats: int = 3) -> dict:
    """Tokens per second of the course loop and of model.generate, producing the same greedy tokens.
    Both are warmed up, then timed alternately `repeats` times; the best time of each counts."""
    ids = torch.tensor([prompt_ids], device=model.device)
    kwargs = dict(max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False)

    def theirs():
        with torch.inference_mode():
            return model.generate(ids, **kwargs)

    run_with_cache(model, prompt_ids, 2)
    theirs()
    ours_best, their_best, ours, out = float("inf"), float("inf"), None, None
    for _ in range(repeats):
        ours = run_with_cache(model, prompt_ids, n_new)
        ours_best = min(ours_best, ours.total)
        their = time_it(theirs, model.device, repeats=1, warmup=0)
        their_best = min(their_best, their.best)
    out = theirs()
    same = out[0, len(prompt_ids):].tolist() == ours.token_ids
    return {"tokens": n_new, "same_tokens": same, "loop_tokens_per_s": n_new / ours_best,
            "generate_tokens_per_s": n_new / their_best, "ratio": their_best / ours_best}


def cache_ratios(model, prompt_ids: list[int], lengths: list[int]) -> list[dict]:
    """Time without the KV cache divided by time with it, for several numbers of new tokens.
    After a warm-up, the cached run (seconds long) is timed twice and the best kept; the uncached run
    (up to a minute) once, which already averages over many steps."""
    run_with_cache(model, prompt_ids, 4)  # warm-up
    rows = []
    for n in lengths:
        with_cache = min((run_with_cache(model, prompt_ids, n) for _ in range(2)), key=lambda r: r.total)
        without = run_without_cache(model, prompt_ids, n)
        rows.append({"new_tokens": n, "cached_s": with_cache.total, "uncached_s": without.total,
                     "ratio": without.total / with_cache.total, "same_tokens": with_cache.token_ids == without.token_ids,
                     "positions_cached": with_cache.positions_processed, "positions_uncached": without.positions_processed})
    return rows


def widget_redraw_ms(model, tokenizer) -> dict:
    """Median redraw time of the sampling and attention explorers (Python side, no browser)."""
    from .forward import forward_logits
    from .widgets import AttentionExplorer, SamplingExplorer
    logits = forward_logits(model, story_ids(tokenizer))[0, -1]
    labels = {i: tokenizer.decode([i]) for i in torch.topk(logits, 60).indices.tolist()}
    sampler = SamplingExplorer(logits, labels)
    s_times = []
    for t in [0.2, 0.5, 0.8, 1.1, 1.4, 1.7, 2.0]:
        sampler.temperature.value = t
        s_times.append(sampler.last_update_ms)
    attention = AttentionExplorer(torch.rand(30, 9, 12, 12).tril(), [f"t{i}" for i in range(12)])
    a_times = []
    for layer in range(1, 8):
        attention.layer.value = layer
        a_times.append(attention.last_update_ms)
    return {"sampling_explorer_ms": sorted(s_times)[len(s_times) // 2],
            "attention_explorer_ms": sorted(a_times)[len(a_times) // 2]}


def run(model, tokenizer, quick: bool = False, progress=print) -> dict:
    """Every measurement of the benchmark command, in one run on one device. quick: tiny sizes (for tests)."""
    from .loading import _load, weights_cache_dir
    prompt = story_ids(tokenizer)
    result = {"when": datetime.now(timezone.utc).isoformat(timespec="seconds"), "host": platform.node(),
              "machine": describe_device(model.device), "dtype": str(model.dtype).split(".")[-1], "quick": quick}
    progress("loading time (cached weights)")
    start = time.perf_counter()
    _load.__wrapped__(str(weights_cache_dir()), (("local_files_only", True),), str(model.device),
                      result["dtype"], "sdpa")
    result["load_seconds"] = time.perf_counter() - start
    progress("course loop against model.generate")
    result["loop_vs_generate"] = loop_vs_generate(model, prompt, 8 if quick else 128)
    progress("with and without the KV cache")
    result["cache"] = cache_ratios(model, prompt, [4, 8] if quick else [32, 128, 256])
    progress("prefill against prompt length")
    lengths = [16, 64] if quick else [16, 64, 256, 1024]
    seconds = prefill_seconds(model, tokenizer, lengths)
    result["prefill"] = [{"tokens": n, "seconds": s, "tokens_per_s": n / s} for n, s in zip(lengths, seconds)]
    progress("decode against context length, and memory bandwidth")
    contexts = [16, 256] if quick else [16, 256, 1024, 4096]
    step = decode_seconds(model, tokenizer, contexts)
    result["decode"] = [{"context": c, "seconds_per_token": s} for c, s in zip(contexts, step)]
    bandwidth = memory_bandwidth(model.device, 64 if quick else 512)
    achieved = weight_bytes(model) / step[0]
    result["bandwidth"] = {"weight_bytes": weight_bytes(model), "measured_copy_bytes_per_s": bandwidth,
                           "decode_achieved_bytes_per_s": achieved, "utilisation": achieved / bandwidth}
    progress("widget redraws")
    result["widgets"] = widget_redraw_ms(model, tokenizer)
    return result


def targets(result: dict) -> list[tuple[str, str, bool]]:
    """The course's speed targets, as (what, measured, met)."""
    lvg = result["loop_vs_generate"]
    cache_256 = next((r for r in result["cache"] if r["new_tokens"] == 256), result["cache"][-1])
    widgets = result["widgets"]
    return [
        ("course loop at least as fast as model.generate", f"{lvg['ratio']:.2f}x (same tokens: {lvg['same_tokens']})",
         lvg["ratio"] >= 1.0 and lvg["same_tokens"]),
        (f"cache at least 5x faster than no cache at {cache_256['new_tokens']} new tokens",
         f"{cache_256['ratio']:.1f}x", cache_256["ratio"] >= 5.0),
        ("cached model load about a second", f"{result['load_seconds']:.2f} s", result["load_seconds"] < 2.0),
        ("sampling explorer redraw well under 100 ms", f"{widgets['sampling_explorer_ms']:.1f} ms",
         widgets["sampling_explorer_ms"] < 100),
        ("attention explorer redraw well under 100 ms", f"{widgets['attention_explorer_ms']:.1f} ms",
         widgets["attention_explorer_ms"] < 100),
    ]


def format_report(result: dict) -> str:
    m = result["machine"]
    lines = [f"benchmark on {m['name']} ({m['device']}, {result['dtype']}), {result['when']}", ""]
    lvg = result["loop_vs_generate"]
    lines.append(f"course loop {lvg['loop_tokens_per_s']:.1f} tok/s | model.generate {lvg['generate_tokens_per_s']:.1f} tok/s")
    for r in result["cache"]:
        lines.append(f"{r['new_tokens']:>4} new tokens: cache {r['cached_s']:.2f} s, no cache {r['uncached_s']:.2f} s "
                     f"-> {r['ratio']:.1f}x; positions {r['positions_cached']} vs {r['positions_uncached']}")
    lines.append("prefill: " + ", ".join(f"{p['tokens']} tok {p['tokens_per_s']:.0f} tok/s" for p in result["prefill"]))
    lines.append("decode:  " + ", ".join(f"ctx {d['context']} {d['seconds_per_token'] * 1000:.1f} ms/tok"
                                         for d in result["decode"]))
    bw = result["bandwidth"]
    lines.append(f"bandwidth: copy {bw['measured_copy_bytes_per_s'] / 1e9:.1f} GB/s, decode reads weights at "
                 f"{bw['decode_achieved_bytes_per_s'] / 1e9:.1f} GB/s -> utilisation {bw['utilisation']:.0%}")
    lines += ["", f"{'target':<52} {'measured':<28} met"]
    lines += [f"{what:<52} {measured:<28} {'yes' if met else 'NO'}" for what, measured, met in targets(result)]
    return "\n".join(lines)


def save(result: dict, folder: Path) -> tuple[Path, Path]:
    """Write result JSON and a PNG figure (prefill and decode curves) into folder."""
    import matplotlib
    matplotlib.use("Agg")
    from . import plots_perf
    folder.mkdir(parents=True, exist_ok=True)
    name = f"bench-{result['machine']['device'].split(':')[0]}-{result['when'][:10]}"
    json_path, png_path = folder / f"{name}.json", folder / f"{name}.png"
    json_path.write_text(json.dumps(result, indent=2))
    fig = plots_perf.plot_benchmark(result)
    fig.savefig(png_path, dpi=110)
    return json_path, png_path
