"""The bench sections of Part I's loop and views: the course's loop against model.generate, the KV cache's gain,
the streaming detokenizer's cost per token, and how fast the widgets redraw.

What it does: `loop_vs_generate` (lesson 06: generation.generate against model.generate, same tokens),
`cache_ratios` (lesson 07: time without the cache over time with it), `detokenize_ms_per_token` (lesson 06:
constant per token, or not), and the widgets' redraw times (lesson 05's explorers); each a Section with its targets
and its report lines.
What it does not do: draw, or time anything a lesson does not show.
"""
from __future__ import annotations

import time

import torch

from ..text.context import filler_ids, story_ids
from ..engine.request import Stopper
from .section import Section
from .speed import cached_run, uncached_run
from ..runtime import median


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


def detokenize_ms_per_token(tokenizer, n: int, last: int = 100) -> float:
    """Milliseconds per token of the streaming detokenizer plus a stop-string check, over the last `last` of
    n tokens of real text (constant per token if the decoder only decodes a short window)."""
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
    from ..runner.forward import forward_logits
    from ..views.html_views import attention_table, sampling_view, tokenizer_comparison
    from ..engine.sampling import SamplingConfig
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


def _loop_targets(result: dict) -> list:
    lvg = result["loop_vs_generate"]
    return [("generation.generate at least as fast as model.generate",
             f"{lvg['ratio']:.2f}x (same tokens: {lvg['same_tokens']})", lvg["ratio"] >= 1.0 and lvg["same_tokens"])]


def _loop_report(result: dict) -> list:
    lvg = result["loop_vs_generate"]
    return [f"generation.generate {lvg['loop_tokens_per_s']:.1f} tok/s | model.generate "
            f"{lvg['generate_tokens_per_s']:.1f} tok/s"]


def _cache_targets(result: dict) -> list:
    cache_256 = next((r for r in result["cache"] if r["new_tokens"] == 256), result["cache"][-1])
    return [(f"cache at least 5x faster than no cache at {cache_256['new_tokens']} new tokens",
             f"{cache_256['ratio']:.1f}x", cache_256["ratio"] >= 5.0)]


def _cache_report(result: dict) -> list:
    return [f"{r['new_tokens']:>4} new tokens: cache {r['cached_s']:.2f} s, no cache {r['uncached_s']:.2f} s "
            f"-> {r['ratio']:.1f}x; positions {r['positions_cached']} vs {r['positions_uncached']}" for r in result["cache"]]


def _widgets_targets(result: dict) -> list:
    w = result["widgets"]
    return [("sampling explorer redraw well under 100 ms", f"{w['sampling_explorer_ms']:.1f} ms",
             w["sampling_explorer_ms"] < 100),
            ("attention explorer redraw well under 100 ms", f"{w['attention_explorer_ms']:.1f} ms",
             w["attention_explorer_ms"] < 100)]


def _detokenize_targets(result: dict) -> list:
    d = result["detokenize"]
    long_key = "ms_per_token_at_8000"
    return [("detokenizer: a token costs the same at 8,000 tokens as at 100 (within 2x)",
             f"{d['ms_per_token_at_100']:.3f} vs {d[long_key]:.3f} ms", d[long_key] < 2 * d["ms_per_token_at_100"])]


LOOP_VS_GENERATE = Section("loop_vs_generate", "generation.generate against model.generate", lambda m, t, q: {
    "loop_vs_generate": loop_vs_generate(m, t, story_ids(t), 8 if q else 128)}, _loop_targets, _loop_report)
CACHE = Section("cache", "with and without the KV cache", lambda m, t, q: {
    "cache": cache_ratios(m, t, story_ids(t), [4, 8] if q else [32, 128, 256])}, _cache_targets, _cache_report)
WIDGETS = Section("widgets", "widget redraws", lambda m, t, q: {"widgets": _widgets_section(m, t)}, _widgets_targets)
DETOKENIZE = Section("detokenize", "streaming detokenizer cost per token", lambda m, t, q: {"detokenize": {
    "ms_per_token_at_100": detokenize_ms_per_token(t, 100),
    "ms_per_token_at_8000": detokenize_ms_per_token(t, 1000 if q else 8000)}}, _detokenize_targets)
