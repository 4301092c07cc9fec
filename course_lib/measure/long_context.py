"""Measurements for lesson 17 (long context): time per decode step against context, the strategies past the
end of the cache's budget, the quantized cache's cost and gain, and the needle grid; the bench section
`long_context`.

What it does: `filled_cache` (a cache holding n tokens of random numbers: a step's time does not depend on the values
it reads), `step_times` and `step_ms` (decode steps at a context, each or their median), `step_curve` (time per token
against context, with its spread and the bytes read per step), `static_step_ms` (the float and the 8-bit cache
through the compiled static step), `strategies` (long_context.stream_loss under every
strategy at one budget), `kv_quality` (perplexity with the float, 8-bit and 4-bit caches on one text), `needle_grid`
(the fact found or not, per length and depth), and `long_context_section`.
What it does not do: define the caches or the strategies (long_context.py) or draw (plots_long.py).
"""
from __future__ import annotations

import torch

from ..runner.forward import run_model
from ..runner.static_step import StaticDecode, compile_available
from ..engine.generation import generate
from ..engine.long_context import (QuantizedKVCache, cache_bytes_per_token, crossover_tokens, found, long_text_ids,
                                   needle_ids, stream_loss, KV_FORMATS, KV_TILE)
from .timers import TIMING_TOKEN, best_of
from ..runtime import median
from .section import Section


def filled_cache(model, context: int, bits: int | None = None):
    """A cache for one row holding `context` tokens of random keys and values (room for one more), float in
    the model's dtype or quantized to `bits`."""
    if bits is None:
        cache = model.new_cache(1, context + 1)
        for t in cache.keys + cache.values:
            t.normal_()
    else:
        cache = QuantizedKVCache(model, 1, context + 1, bits)
        for t in cache.keys + cache.values:
            t.random_(-127 if bits == 8 else 0, 128 if bits == 8 else 256)
    cache.length = context
    return cache


def step_times(model, context: int, bits: int | None = None, repeats: int = 5) -> list[float]:
    """Milliseconds of each of `repeats` decode steps (batch 1) after `context` tokens, after a warm-up."""
    cache, token = filled_cache(model, context, bits), torch.tensor([[TIMING_TOKEN]], device=model.device)

    def one():
        cache.length = context
        run_model(model, token, cache)
    return [1000 * best_of(one, 1, model.device, warmup=int(i == 0))[0] for i in range(repeats)]


def step_ms(model, context: int, bits: int | None = None, repeats: int = 5) -> float:
    """Milliseconds of one decode step (batch 1) after `context` tokens: the median of `repeats`, after a warm-up."""
    return median(step_times(model, context, bits, repeats))


def static_step_ms(model, context: int, rounds: int = 5, compile: bool = True, fused: bool = False) -> dict:
    """Milliseconds of one decode step (batch 1) after `context` tokens through one static_step.StaticDecode of
    capacity context + 1 (compiled unless compile=False; fused=True: the int4-q8 format's one C++ call, nothing
    compiled), on the float cache and on the 8-bit one (which the step reads as integers and scales), alternated
    `rounds` times so a busy moment hits both: {"float": median, "int8": median, "compile_s": the seconds the first
    call of each took}."""
    step = StaticDecode(model, 1, context + 1, compile=compile and not fused, fused=fused)
    caches = {"float": filled_cache(model, context), "int8": filled_cache(model, context, 8)}

    def one(cache):
        cache.length = context
        step([[TIMING_TOKEN]], cache)
    first = {name: best_of(lambda: one(cache), 1, model.device, warmup=0)[0] for name, cache in caches.items()}
    times = {name: [] for name in caches}
    for _ in range(rounds):
        for name, cache in caches.items():
            times[name].append(1000 * best_of(lambda: one(cache), 1, model.device, warmup=0)[0])
    return {**{name: median(v) for name, v in times.items()}, "compile_s": first}


def step_curve(model, contexts: list[int], repeats: int = 5) -> list[dict]:
    """Time per decode step against context (the median of `repeats` steps, with the fastest and the slowest, so
    a figure can show the spread), with the bytes one step reads (weights, then the cache's columns)."""
    fmt = "float32" if model.dtype == torch.float32 else "bfloat16"
    per_token = cache_bytes_per_token(model, fmt)
    curve = []
    for n in contexts:
        times = step_times(model, n, repeats=repeats)
        curve.append({"context": n, "ms": median(times), "ms_min": min(times), "ms_max": max(times),
                      "weight_bytes": model.weight_bytes(), "cache_bytes": per_token * n})
    return curve


def strategies(model, ids: list[int], budget: int, chunk: int, sinks: int = 4) -> dict:
    """Every strategy over the same text at one budget; "full" only over the text's first window."""
    window = model.config.max_position_embeddings
    runs = {"full": stream_loss(model, ids[:window], "full", budget, chunk)}
    for name in ("restart", "window", "sinks"):
        runs[name] = stream_loss(model, ids, name, budget, chunk, sinks)
    return runs


def kv_quality(model, ids: list[int], chunk: int = 256, bits: tuple[int, ...] = (8, 4)) -> dict:
    """Perplexity of one text fed `chunk` tokens at a time with the float cache and each quantized one, and the
    bytes each cache holds for the text."""
    base = stream_loss(model, ids, "full", len(ids), chunk)
    out = {"float": {"ppl": base.perplexity(), "bytes": model.new_cache(1, len(ids)).nbytes()}}
    for b in bits:
        cache = QuantizedKVCache(model, 1, len(ids), b)
        run = stream_loss(model, ids, "full", len(ids), chunk, cache=cache)
        out[f"int{b}"] = {"ppl": run.perplexity(), "bytes": cache.nbytes(), "ppl_ratio": run.perplexity() / base.perplexity()}
    return out


@torch.inference_mode()
def needle_grid(model, tokenizer, lengths: list[int], depths: list[float], seed: int = 0) -> list[dict]:
    """For each length and depth: the needle prompt, 16 greedy tokens, and whether they hold the secret number.
    The secret is a fresh 4-digit number per cell (drawn from `seed`)."""
    filler = long_text_ids(tokenizer, max(lengths) + 200)
    draw = torch.Generator(device="cpu").manual_seed(seed)  # note: secrets are drawn on the CPU, on purpose
    cells = []
    for length in lengths:
        for depth in depths:
            secret = int(torch.randint(1000, 10000, (1,), generator=draw))
            ids = needle_ids(tokenizer, filler, length, depth, secret)
            answer = generate(model, tokenizer, ids, 16, stop_ids=()).text  # 16 greedy tokens, the lessons' loop
            cells.append({"length": len(ids), "asked_length": length, "depth": depth, "secret": secret,
                          "answer": answer.strip(), "found": found(answer, secret)})
    return cells


def long_context_section(model, tokenizer, quick: bool = False) -> dict:
    """Lesson 17 on the course's model (float32, and the int4 format for its weight bytes): bytes per token of each
    cache format and where the cache outweighs the weights, time per step against context, the strategies past the
    budget and past the model's window, the 8-bit cache's perplexity, capacity and step time, and the needle grid."""
    from ..runner.formats import convert
    from ..runner.fused_step import why_not_fused
    from ..runner.model import Model
    ours = Model.from_transformers(model if model.dtype == torch.float32 else model.float(), dtype=torch.float32)
    int4 = convert(ours, "int4")
    per_token = {f: cache_bytes_per_token(ours, f) for f in KV_FORMATS}
    weights = {"float32": ours.weight_bytes(), "int4": int4.weight_bytes()}
    crossover = {w: {f: crossover_tokens(b, per_token[f]) for f in KV_FORMATS} for w, b in weights.items()}
    contexts = [64, 256, 512] if quick else [256, 1024, 2048, 4096, 8000]
    curve = step_curve(ours, contexts, repeats=2 if quick else 5)
    curve_int4 = step_curve(int4, contexts, repeats=2 if quick else 5)
    budget, chunk, n = (128, 32, 400) if quick else (1024, 128, 10240)
    text = long_text_ids(tokenizer, n)
    runs = strategies(ours, text, budget, chunk)
    window = ours.config.max_position_embeddings
    inside = {name: r.perplexity(budget) if name == "full" else float(torch.exp(r.nll[budget:window - 1].mean()))
              for name, r in runs.items()}
    past = {name: r.perplexity(window - 1) for name, r in runs.items() if name != "full" and len(text) > window}
    quality = kv_quality(ours, text[:256 if quick else 4096], chunk=64 if quick else 256)
    at = 256 if quick else 2048
    steps = {"float": [], "int8": [], "int4": []}
    for _ in range(2 if quick else 5):  # note: the three caches alternated, so a busy moment hits all of them
        for name, bits in (("float", None), ("int8", 8), ("int4", 4)):
            steps[name].append(step_ms(ours, at, bits, repeats=1))
    step = {name: median(v) for name, v in steps.items()}
    # the 8-bit cache through the compiled step, on the engine's format (int4 weights, bfloat16 activations and
    # float cache); quick: the same static step uncompiled, a check of the mechanics only
    compiled_at, compiles = (255, False) if quick else (4095, compile_available()[0])
    fused = static_step_ms(int4, compiled_at, rounds=2 if quick else 7, compile=compiles)
    # the same two caches through the engine's fastest step (int4-q8: one C++ call, the integers read in place)
    q8 = convert(ours, "int4-q8")
    why_not = why_not_fused(q8)
    one_call = {} if why_not else static_step_ms(q8, compiled_at, rounds=2 if quick else 7, fused=True)
    capacity = quality["float"]["bytes"] / quality["int8"]["bytes"]
    needle = needle_grid(ours, tokenizer, [256, 512] if quick else [1024, 2048, 4096, 8000], [0.1, 0.5, 0.9] if quick
                         else [0.0, 0.25, 0.5, 0.75, 1.0])
    return {"kv_bytes_per_token": per_token, "weight_bytes": weights, "crossover_tokens": crossover,
            "step_curve": curve, "step_curve_int4": curve_int4, "budget": budget, "chunk": chunk,
            "text_tokens": len(text), "sinks": 4,
            "seconds": {name: r.seconds for name, r in runs.items()},
            "recomputed_tokens": runs["restart"].recomputed,
            "ppl_full": inside["full"], "ppl_restart": inside["restart"], "ppl_window": inside["window"],
            "ppl_sinks": inside["sinks"], "ppl_past_model_window": past,
            "kv_quality": quality, "kv8_ppl_ratio": quality["int8"]["ppl_ratio"], "kv8_capacity_ratio": capacity,
            "kv8_capacity_ratio_vs_bfloat16": per_token["bfloat16"] / per_token["int8"],
            "kv_step_ms_eager": step, "kv_step_context_eager": at, "kv_tile": KV_TILE,
            "kv8_step_ratio_eager": step["int8"] / step["float"],
            "kv_step_ms": {"float": fused["float"], "int8": fused["int8"]}, "kv_step_context": compiled_at + 1,
            "kv_step_compiled": compiles, "kv_step_compile_s": fused["compile_s"],
            "kv_step_format": "int4 weights, bfloat16 activations and float cache",
            "kv8_step_ratio": fused["int8"] / fused["float"],
            "kv_step_ms_fused": {k: one_call[k] for k in ("float", "int8")} if one_call else {},
            "kv8_step_ratio_fused": one_call["int8"] / one_call["float"] if one_call else None,
            "kv_step_fused_why_not": why_not,
            "needle": {f"{c['asked_length']}@{c['depth']}": c["found"] for c in needle}, "needle_cells": needle}


def long_context_targets(lc: dict) -> list[tuple[str, str, bool]]:
    """The issue's targets for the section: sinks beat the plain window past the budget; the 8-bit cache within 1%
    perplexity, at least 1.9x the tokens of a 16-bit cache in the same memory, a step at most 10% slower."""
    return [("long context: sinks beat the plain window past the budget",
             f"{lc['ppl_sinks']:.2f} vs {lc['ppl_window']:.2f}", lc["ppl_sinks"] < lc["ppl_window"]),
            ("long context: 8-bit cache perplexity within 1% of the float cache's", f"x{lc['kv8_ppl_ratio']:.4f}",
             abs(lc["kv8_ppl_ratio"] - 1) <= 0.01),
            ("long context: 8-bit cache holds >= 1.9x a bfloat16 cache's tokens",
             f"{lc['kv8_capacity_ratio_vs_bfloat16']:.2f}x (float32: {lc['kv8_capacity_ratio']:.2f}x)",
             lc["kv8_capacity_ratio_vs_bfloat16"] >= 1.9),
            (f"long context: 8-bit cache decode at most 10% slower, eager ({lc['kv_step_context_eager']} tokens)",
             f"x{lc['kv8_step_ratio_eager']:.2f}", lc["kv8_step_ratio_eager"] <= 1.10),
            (f"long context: 8-bit cache decode no slower through the compiled step ({lc['kv_step_context']} tokens)",
             f"x{lc['kv8_step_ratio']:.2f}" + ("" if lc["kv_step_compiled"] else " (not compiled)"),
             lc["kv8_step_ratio"] <= 1.0)] + (
        [(f"long context: 8-bit cache decode no slower through the fused step (int4-q8, {lc['kv_step_context']} tokens)",
          f"x{lc['kv8_step_ratio_fused']:.2f}", lc["kv8_step_ratio_fused"] <= 1.0)]
        if lc.get("kv8_step_ratio_fused") is not None else [])


def long_context_report(lc: dict) -> list[str]:
    """Lines for the bench's text report."""
    curve = ", ".join(f"{c['context']}: {c['ms']:.1f}" for c in lc["step_curve"])
    if "step_curve_int4" in lc:
        curve += " (float32); " + ", ".join(f"{c['context']}: {c['ms']:.1f}" for c in lc["step_curve_int4"]) + " (int4)"
    ppl = ", ".join(f"{n} {lc['ppl_' + n]:.2f}" for n in ("full", "restart", "window", "sinks"))
    past = ", ".join(f"{n} {p:.2f}" for n, p in lc["ppl_past_model_window"].items()) or "not reached"
    q = lc["kv_quality"]
    return [f"long context: ms per decode step by context {curve}",
            f"long context: crossover (tokens) {lc['crossover_tokens']}",
            f"long context: budget {lc['budget']}, perplexity past it {ppl}; past the model's window: {past}",
            f"long context: caches int8 x{q['int8']['ppl_ratio']:.4f}, int4 x{q['int4']['ppl_ratio']:.4f} perplexity; step "
            + ", ".join(f"{n} {ms:.1f} ms" for n, ms in lc["kv_step_ms_eager"].items())
            + f" (eager, {lc['kv_step_context_eager']} tokens); "
            + ", ".join(f"{n} {ms:.1f} ms" for n, ms in lc["kv_step_ms"].items())
            + f" ({'compiled' if lc['kv_step_compiled'] else 'static, not compiled'}, {lc['kv_step_context']} tokens)"
            + ("; " + ", ".join(f"{n} {ms:.1f} ms" for n, ms in lc["kv_step_ms_fused"].items()) + " (int4-q8, fused)"
               if lc.get("kv_step_ms_fused") else f"; fused step not run: {lc.get('kv_step_fused_why_not', '')}"),
            f"long context: needle found {sum(lc['needle'].values())} of {len(lc['needle'])}"]


SECTION = Section("long_context", "lesson 17: cache bytes, the end of the window, a quantized cache, the needle",
                  lambda m, t, q: {"long_context": long_context_section(m, t, q)},
                  lambda result: long_context_targets(result["long_context"]),
                  lambda result: long_context_report(result["long_context"]))
