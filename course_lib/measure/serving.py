"""The bench's `serving_load` section (lessons 10 and 13): the streaming server under a mixed Poisson load.

What it does: the server on loopback driven by measure.load's trace at several rates, on the contiguous cache, the
paged cache and the paged cache with chunked prefill and prefix caching: time to first token and between tokens,
p50 and p99, throughput, goodput; every answer checked against the same request alone; and the longest wait of a
running request while a long prompt is read, whole against chunked; with its targets and report lines.
What it does not do: send requests itself (measure.load does) or serve (serving.py does).
"""
from __future__ import annotations

import json

import torch

from .section import Section


SERVING_CONFIGS = {  # name -> start_server options (the paged ones serve the course's model)
    "contiguous": {"kv_cache": "contiguous"},
    "paged": {"kv_cache": "paged", "prefix_caching": False},
    "paged_chunked": {"kv_cache": "paged", "prefix_caching": True, "token_budget": 128},
}
TTFT_TARGET_S, GAP_TARGET_S = 10.0, 1.0  # goodput: first token within 10 s, no wait between tokens over 1 s (CPU)


def serving_load_section(model, tokenizer, quick: bool = False) -> dict:
    """Lessons 10 and 13 under load: the streaming server on loopback, driven by a mixed Poisson trace (measure.load)
    at several rates, on three configurations in one run: the contiguous cache (continuous batching on the
    library's model), the paged cache (the course's model, whole prefill, no prefix cache) and the paged cache
    with chunked prefill (128 tokens per step) and prefix caching. Greedy, so every answer is checked against the
    same request alone on the same runner. Then, in one process, the longest gap of a running request while a
    long prompt is read, whole against chunked (max_decode_gap_s)."""
    from ..text.context import context_ids, handbook_ids, chat_ids
    from ..engine.generation import generate
    from .load import decode_gaps, mixed_trace, replay, summarize
    from ..runner.model import Model
    from ..serve.serving import free_port, start_server
    library = model if model.dtype == torch.float32 else model.float()
    ours = Model.from_transformers(library, dtype=torch.float32)
    rates = [1.0] if quick else [0.25, 0.5]
    n, max_tokens = (2, 6) if quick else (14, 32)
    traces = {rate: mixed_trace(rate, n, seed=i, max_tokens=max_tokens) for i, rate in enumerate(rates)}
    alone: dict = {}

    def alone_text(runner, messages):
        key = (id(runner), json.dumps(messages))
        if key not in alone:
            ids = context_ids(tokenizer, messages)
            alone[key] = generate(runner, tokenizer, ids, max_tokens).text
        return alone[key]

    out = {"rates": rates, "requests_per_rate": n, "max_tokens": max_tokens, "configs": list(SERVING_CONFIGS),
           "ttft_target_s": TTFT_TARGET_S, "gap_target_s": GAP_TARGET_S}
    figures = {k: {} for k in ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "goodput_rps", "tokens_per_s",
                               "finished", "max_gap_s")}
    same = True
    for name, options in SERVING_CONFIGS.items():
        runner = library if options["kv_cache"] == "contiguous" else ours
        handle = start_server(runner, tokenizer, free_port(), max_tokens_cap=max_tokens, max_concurrent=64, **options)
        try:
            for rate in rates:
                outcomes, wall = replay(handle.url, traces[rate], timeout=600)
                summary = summarize(outcomes, wall, TTFT_TARGET_S, GAP_TARGET_S)
                for key in figures:
                    figures[key].setdefault(name, []).append(summary[key])
                same &= all(o.error is None and o.text == alone_text(runner, r.messages)
                            for o, r in zip(outcomes, traces[rate]))
        finally:
            handle.stop()
    out.update(figures)
    out["same_answers"] = same
    chat, long = chat_ids(tokenizer, "Write a short story about a robot who learns to paint."), handbook_ids(tokenizer, "Hi")
    whole, chunked = (decode_gaps(ours, chat, long[:300] if quick else long, budget)
                      for budget in (None, SERVING_CONFIGS["paged_chunked"]["token_budget"]))
    out["max_decode_gap_s"] = {"whole": whole["max_gap_s"], "chunked": chunked["max_gap_s"]}
    out["decode_gap_tokens_per_s"] = {"whole": whole["tokens_per_s"], "chunked": chunked["tokens_per_s"]}
    out["decode_gap_same_tokens"] = whole["tokens"] == chunked["tokens"]
    return out


def _targets(result: dict) -> list:
    out = []
    s = result["serving_load"]
    whole, chunked = s["itl_p99_s"]["paged"][-1], s["itl_p99_s"]["paged_chunked"][-1]
    tps_whole, tps_chunked = s["tokens_per_s"]["paged"][-1], s["tokens_per_s"]["paged_chunked"][-1]
    out.append(("serving: every request answered, each as alone (greedy)", str(s["same_answers"]), s["same_answers"]))
    out.append((f"serving: chunked prefill cuts p99 time between tokens at least 3x ({s['rates'][-1]} req/s)",
                f"{whole:.2f} -> {chunked:.2f} s ({whole / chunked:.1f}x)", whole >= 3 * chunked))
    out.append(("serving: chunked prefill loses at most 10% throughput",
                f"{tps_chunked:.1f} vs {tps_whole:.1f} tok/s", tps_chunked >= 0.9 * tps_whole))
    return out


def _report(result: dict) -> list:
    lines = []
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
    return lines


SECTION = Section("serving_load", "lessons 10 and 13: the server under a mixed Poisson load",
                  lambda m, t, q: {"serving_load": serving_load_section(m, t, q)}, _targets, _report)
