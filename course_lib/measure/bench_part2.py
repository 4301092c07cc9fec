"""The benchmark's Part II sections: the course's own engine against the library, one section per lesson.

What it does: `engine_section` (lesson 11: our model against model.generate, short and long context),
`formats_section` (lesson 12: every weight format's bytes, speed and quality), `paged_section` (lesson 13:
measure.trace.bench_section), `speculative_section` (lesson 14: each drafter on two tasks) and
`structured_section` (lesson 15: free against constrained JSON). Each returns the dict bench.run() files
under the section's name; its keys are the JSON keys the issues name.
What it does not do: run sections, print or save (bench.py does).
"""
from __future__ import annotations

import json
import time

import torch

from ..context import filler_ids, story_ids
from .timers import median


def engine_section(model, tokenizer, quick: bool = False) -> dict:
    """Lesson 11: our model written out (float32, batch 1) against the library's model.generate."""
    from .race import long_context, our_step_seconds, race, step_anatomy
    from ..model import Model
    ours = Model.from_transformers(model, dtype=torch.float32)
    library = model if model.dtype == torch.float32 else model.float()
    story = story_ids(tokenizer)
    r = race(ours, library, tokenizer, story, 8 if quick else 128, repeats=2 if quick else 3)
    long = long_context(ours, library, tokenizer, filler_ids(tokenizer, 256 if quick else 4000), k=4 if quick else 16)
    weights = ours.weight_bytes()
    # what the layout choice is worth: ours against ours with every matrix by rows (the library's layout),
    # both timed by the median gap between tokens
    by_rows = Model.from_transformers(model, dtype=torch.float32, layout="rows")
    gap = lambda m_: median(our_step_seconds(m_, tokenizer, story, 17 if quick else 49))  # noqa: E731
    rows_gap, built_gap = gap(by_rows), gap(ours)
    del by_rows
    linears = {name: getattr(ours.layers[0], name) for name in ("qkv", "o", "gate_up", "down")} | {"head": ours.lm_head}
    layouts = {name: linear.layout for name, linear in linears.items()}
    kernels = {name: linear.kernel for name, linear in linears.items()}  # for two or more rows at once
    # a decode step at batch 1 taken apart: operators counted, products alone, the rest (the ops_per_step)
    anatomy = {"float32": step_anatomy(ours, story, steps=5 if quick else 40)}
    if ours.device.type == "cpu":  # the fastest format here; its 4-bit kernel is a CPU kernel
        from ..formats import convert
        anatomy["int4"] = step_anatomy(convert(ours, "int4"), story, steps=5 if quick else 40)
    # the static-shape step, eager and compiled (the engine.compiled); --quick does not wait for a compile
    from .compiled import compiled_comparison
    compiled = compiled_comparison(ours, tokenizer, story, 6 if quick else 48, compile=not quick)
    return {"ops_per_step": anatomy, "compiled": compiled, "new_tokens": r["new_tokens"], "tokens_per_s": r["tokens_per_s"],
            "generate_tokens_per_s": r["generate_tokens_per_s"], "ratio": r["ratio"], "same_tokens": r["same_tokens"],
            "long_context_tokens": long["context"], "long_context_ms_per_token": long["ms_per_token"],
            "long_context_generate_ms_per_token": long["generate_ms_per_token"], "long_context_ratio": long["ratio"],
            "weight_bytes": weights, "bandwidth_bytes_per_s": weights * r["tokens_per_s"],
            "layouts": layouts, "several_rows_kernels": kernels, "rows_step_ms": rows_gap * 1000, "built_step_ms": built_gap * 1000,
            "layout_speedup": rows_gap / built_gap}


def formats_section(model, tokenizer, quick: bool = False) -> dict:
    """Lesson 12: every weight format of our model, batch 1: bytes per token, decode tokens per second (the
    median gap between tokens, prefill excluded, as for model.generate beside it), and quality against
    float32 on the bench's prompts (teacher-forced top-1 agreement and mean KL over the answers)."""
    from ..context import chat_ids
    from .race import generate_exact, library_step_seconds, our_step_seconds
    from ..formats import FORMATS, convert
    from .memory import read_bandwidth
    from .quality import agreement
    from ..model import Model
    reference = Model.from_transformers(model, dtype=torch.float32)
    library = model if model.dtype == torch.float32 else model.float()
    prompt, n = story_ids(tokenizer), 6 if quick else 48
    questions = ["What is the capital of France?", "What is the capital gains tax in France?",
                 "The bank is closed because they had no money left."]
    prompts = [chat_ids(tokenizer, q, system="You are a helpful assistant.") for q in questions] + [prompt]
    sequences = [p + generate_exact(reference, tokenizer, p, 8 if quick else 32) for p in prompts]
    library_step_seconds(library, prompt, 3)  # warm-up
    generate_tps = 1 / median(library_step_seconds(library, prompt, n + 1))
    rows, greedy32 = [], generate_exact(reference, tokenizer, prompt, n)
    for name in FORMATS:
        fmt = reference if name == "float32" else convert(reference, name)
        our_step_seconds(fmt, tokenizer, prompt, 3)  # warm-up
        gaps = our_step_seconds(fmt, tokenizer, prompt, n + 1)
        quality = {"top1_agreement": 1.0, "kl": 0.0} if name == "float32" else \
            agreement(reference, fmt, sequences, [len(p) - 1 for p in prompts])
        tps = 1 / median(gaps)
        rows.append({"name": name, "weight_bytes": fmt.weight_bytes(), "tokens_per_s": tps,
                     "top1_agreement": quality["top1_agreement"], "kl": quality["kl"],
                     "bandwidth_bytes_per_s": fmt.weight_bytes() * tps,
                     "same_greedy_tokens": generate_exact(fmt, tokenizer, prompt, n) == greedy32})
    fastest = max(rows, key=lambda r: r["tokens_per_s"])
    return {"formats": rows, "threads": torch.get_num_threads(), "new_tokens": n,
            "generate_tokens_per_s": generate_tps, "read_bandwidth_bytes_per_s": read_bandwidth(256 if quick else 1024),
            "fastest": {"name": fastest["name"], "tokens_per_s": fastest["tokens_per_s"],
                        "ratio_to_generate": fastest["tokens_per_s"] / generate_tps,
                        "top1_agreement": fastest["top1_agreement"]}}


def speculative_section(model, tokenizer, quick: bool = False, k: int = 4) -> list[dict]:
    """Lesson 14: each drafter on two tasks (a grounded edit, where the answer copies the prompt, and free
    writing), float32, greedy, exactly n tokens: acceptance, tokens per verify step, tokens per second
    against plain greedy decoding of the same model in the same run (best of two each), same tokens."""
    from ..context import edit_ids
    from .race import generate_exact
    from ..formats import convert
    from ..generation import generate
    from ..model import Model
    from ..speculative import ModelDrafter, PromptLookup, early_exit
    ours = Model.from_transformers(model, dtype=torch.float32)
    int4 = convert(ours, "int4")
    drafters = {"prompt_lookup": lambda: PromptLookup(3), "int4_model": lambda: ModelDrafter(int4, "int4 model"),
                "early_exit_8": lambda: early_exit(ours, 8)}
    n, rows = 8 if quick else 64, []
    for task, prompt in {"grounded_edit": edit_ids(tokenizer), "story": story_ids(tokenizer)}.items():
        generate_exact(ours, tokenizer, prompt, 2)  # warm-up
        plain, base = None, float("inf")
        for _ in range(2):
            start = time.perf_counter()
            plain = generate_exact(ours, tokenizer, prompt, n)
            base = min(base, time.perf_counter() - start)
        for name, make in drafters.items():
            best, spec = float("inf"), None
            for _ in range(2):
                start = time.perf_counter()
                spec = generate(ours, tokenizer, prompt, n, stop_ids=(), draft=make(), k=k)
                best = min(best, time.perf_counter() - start)
            st = spec.speculative
            rows.append({"drafter": name, "task": task, "k": k, "acceptance_rate": st.acceptance_rate,
                         "tokens_per_verify": st.tokens_per_verify, "tokens_per_s": n / best,
                         "baseline_tokens_per_s": n / base, "speedup": base / best,
                         "same_tokens": spec.token_ids == plain})
    return rows


def structured_section(model, tokenizer, quick: bool = False) -> dict:
    """Lesson 15: the receipts of data/receipts.json asked free and with the JSON Schema mask: the share that
    parse and validate; milliseconds per token of the engine's mask, of the hand-written mask, and of a
    decode step (medians)."""
    import jsonschema
    from ..context import chat_ids
    from ..generation import generate
    from ..structured import ChoiceMask, MaskLog, generate_json, masked_pick, RECEIPT_SCHEMA, receipt_request, receipts
    items = receipts()[:2] if quick else receipts()
    valid_free = valid_constrained = 0
    mask_s, decode_s = [], []
    for r in items:
        messages = receipt_request(r["text"])
        free = generate(model, tokenizer, chat_ids(tokenizer, messages[0]["content"]), 80)
        decode_s += free.inter_token_seconds
        inner = free.text[free.text.find("{"):free.text.rfind("}") + 1]  # generous: prose around the object is cut
        try:
            jsonschema.validate(json.loads(inner), RECEIPT_SCHEMA)
            valid_free += 1
        except (ValueError, jsonschema.ValidationError):
            pass
        constrained = generate_json(model, tokenizer, messages, RECEIPT_SCHEMA, 96)
        mask_s += constrained.mask.seconds[1:]  # note: the first mask includes compiling the grammar's lexer
        try:
            jsonschema.validate(constrained.value, RECEIPT_SCHEMA)
            valid_constrained += constrained.complete
        except jsonschema.ValidationError:
            pass
    log = MaskLog()
    generate(model, tokenizer, chat_ids(tokenizer, "Is Paris the capital of France? Answer yes or no."), 4,
             pick=masked_pick(ChoiceMask(tokenizer, 2, ["yes", "no"]), log=log))
    return {"requests": len(items), "valid_free": valid_free / len(items), "valid_constrained": valid_constrained / len(items),
            "mask_ms_per_token": 1000 * median(mask_s), "hand_mask_ms_per_token": 1000 * median(log.seconds),
            "decode_ms_per_token": 1000 * median(decode_s)}


def paged_section(model, tokenizer, quick: bool = False) -> dict:
    """Lesson 13: the paged KV cache on the course's model (measure.trace.bench_section)."""
    from .trace import bench_section
    return bench_section(model, tokenizer, quick)


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
    from ..context import context_ids, handbook_ids, chat_ids
    from ..generation import generate
    from .load import decode_gaps, mixed_trace, replay, summarize
    from ..model import Model
    from ..serving import free_port, start_server
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
