"""The fast path measured as the engine runs it (issue: the fast path is the engine): `generate` with the compiled
step against the eager one, and what a decode step of B rows costs against one row.

What it does: `compiled_generate` times the course's whole loop (generation.generate: prefill, picker, records,
detokenizer) on the int4 format, eagerly and with `compiled=True` (runner.compiled.CompiledRunner, its bucket
compiled in an untimed warm-up), alternating, best of `repeats`, and compares the tokens. `batch_scaling` times one
decode step of B rows (B = 1, 2, 4, 8, a cache of `context` tokens) through the engine's eager step and through
the compiled runner's step (one dynamic-shape compile for one row, one for a batch), and gives tokens per second
(B / the median step).
What it does not do: decide anything; the bench's engine section reports these under `compiled_generate` and
`batch_scaling`.
"""
from __future__ import annotations

import time

import torch

from ..engine.generation import generate
from ..engine.stages import decode_step, prefill
from ..runner.compiled import CompiledRunner, bucket
from ..runner.static_step import compile_available
from ..runtime import median, synchronize
from .compiled import first_difference
from .timers import TIMING_TOKEN, best_of


def compiled_generate(model, tokenizer, prompt: list[int], n: int, repeats: int = 3, compile: bool = True) -> dict:
    """Tokens per second of generate(model, ..., n tokens, no early stop) eagerly and compiled (the whole call,
    prefill included), the best of `repeats` each, alternating; the compile time of the first (warm-up) call; the
    tokens of both and where they part. compile=False runs the static steps uncompiled (a quick check of the
    plumbing, not of the speed)."""
    can, why = compile_available()
    runner = CompiledRunner(model, compile=compile and can)
    first = generate(runner, tokenizer, prompt, n, stop_ids=())  # compiles its bucket (untimed warm-up)
    compile_s = sum(step.compile_seconds for step in runner.steps.values())
    want = generate(model, tokenizer, prompt, n, stop_ids=())  # warm-up of the eager side, and its tokens
    eager_s, compiled_s = [], []
    for _ in range(repeats):
        for side, runs in ((model, eager_s), (runner, compiled_s)):
            synchronize(model.device)
            start = time.perf_counter()
            generate(side, tokenizer, prompt, n, stop_ids=())
            runs.append(time.perf_counter() - start)
    eager_tps, compiled_tps = n / min(eager_s), n / min(compiled_s)
    return {"threads": torch.get_num_threads(), "new_tokens": n, "prompt_tokens": len(prompt),
            "compiled": compile and can, "why_not": "" if compile and can else (why or "not asked (--quick)"),
            "step_kind": runner.step_kind,  # fused (int4-q8: one C++ call a step) or compiled (torch.compile)
            "capacity": bucket(len(prompt) + n, model.config.max_position_embeddings), "compile_s": compile_s,
            "eager_tokens_per_s": eager_tps, "compiled_tokens_per_s": compiled_tps, "speedup": compiled_tps / eager_tps,
            "eager_runs_s": eager_s, "compiled_runs_s": compiled_s,
            "same_tokens": first.token_ids == want.token_ids,
            "first_difference": first_difference(first.token_ids, want.token_ids)}


def batch_scaling(model, tokenizer, batches=(1, 2, 4, 8), context: int = 128, steps: int = 9,
                  compile: bool = True, rows_model=None, text: list[int] | None = None) -> dict:
    """One decode step of B rows over a cache of `context` tokens, eager (the engine's decode_step) and through the
    compiled static step: the median of `steps` steps after one warm-up, and tokens per second (B rows / step).
    The rows hold the same prompt (their weights are read once either way; their attention reads each row's own
    columns). rows_model: the same model built with formats.convert(..., rows_int8=R), measured the same way
    under "rows_int8", with the perplexity of `text` through both (one pass of len(text) rows: the int8 copy's
    numbers against the 4-bit kernel's)."""
    can, why = compile_available()
    compile = compile and can
    capacity = bucket(context + steps + 2, model.config.max_position_embeddings)
    # note: "compiled" holds the compiled side's rows (as "eager" the eager side's); whether it was compiled at all
    # is "ran_compiled" (why not: "why_not")
    out = {"threads": torch.get_num_threads(), "context": context, "capacity": capacity, "ran_compiled": compile,
           "why_not": "" if compile else (why or "not asked (--quick)"),
           **_scaling(model, batches, context, steps, capacity, compile)}
    if rows_model is not None:
        from ..runner.formats import int8_copy_bytes
        from .quality import perplexity
        out["rows_int8"] = {"rows_from": rows_model.layers[0].qkv.rows_int8, "int8_bytes": int8_copy_bytes(rows_model),
                            **_scaling(rows_model, batches, context, steps, capacity, compile)}
        if text:
            out["rows_int8"] |= {"text_tokens": len(text), "perplexity_int4": perplexity(model, text),
                                 "perplexity_rows_int8": perplexity(rows_model, text)}
    return out


def _scaling(model, batches, context: int, steps: int, capacity: int, compile: bool) -> dict:
    """batch_scaling's measurement for one model: {"eager": {B: row}, "compiled": {B: row}, "eager_scaling",
    "compiled_scaling", "step_kind"} (step_kind: what the compiled side ran, CompiledRunner.step_kind)."""
    runner = CompiledRunner(model, compile=compile)
    ids = list(range(100, 100 + context))
    rows = {"eager": {}, "compiled": {}, "step_kind": runner.step_kind}
    for B in batches:
        _, cache = prefill(model, torch.tensor([ids] * B), capacity=capacity)  # (B, context) in one pass
        start = cache.length
        times = []
        for _ in range(steps + 1):
            seconds, _ = best_of(lambda: decode_step(model, [TIMING_TOKEN] * B, cache), 1, model.device, warmup=0)
            times.append(seconds)
        cache.length = start
        rows["eager"][B] = _row(B, times[1:])
        run = runner.step_for(B, cache.capacity)  # the engine's own step: one compiled code for every B
        times = []
        for _ in range(steps + 1):
            seconds, _ = best_of(lambda: run([TIMING_TOKEN] * B, cache), 1, model.device, warmup=0)
            times.append(seconds)
        rows["compiled"][B] = _row(B, times[1:]) | {"compile_s": run.compile_seconds}
    for side in ("eager", "compiled"):
        one = rows[side][batches[0]]["tokens_per_s"]
        rows[f"{side}_scaling"] = {B: rows[side][B]["tokens_per_s"] / one for B in batches}
    return rows


def _row(B: int, seconds: list[float]) -> dict:
    ms = 1000 * median(seconds)
    return {"rows": B, "step_ms": ms, "step_ms_min": 1000 * min(seconds), "step_ms_max": 1000 * max(seconds),
            "tokens_per_s": 1000 * B / ms}


def rows_cost(plain, with_int8, rows=(1, 2, 4, 8, 16, 64), repeats: int = 30, course=None) -> dict:
    """Microseconds per call of one 4-bit layer (formats.Int4Linear) for R rows of bfloat16 activations: through
    torch's 4-bit kernel (`plain`) and through the int8 copy's integer product (`with_int8`, built with
    rows_int8; called at every R, whatever its threshold), the median of `repeats` calls after a warm-up. One
    matrix called again and again stays in the CPU's cache: this is the kernels' arithmetic, not a decode step's
    reading of the whole model (batch_scaling measures that). course: the same layer in the int4-q8 format (the
    course's kernel, runner/q4_kernel.py), timed the same way under "course_us"."""
    from ..runner.formats import int8_rows_product
    out = {"rows": list(rows), "int4_us": [], "int8_us": []} | ({"course_us": []} if course is not None else {})
    for R in rows:
        x = torch.randn(R, plain.in_features, dtype=torch.bfloat16)
        calls = (("int4_us", lambda: plain(x)), ("int8_us", lambda: int8_rows_product(x, *with_int8.int8)),
                 ("course_us", lambda: course(x)))
        for key, call in calls[:3 if course is not None else 2]:
            call()
            seconds = []
            for _ in range(repeats):
                start = time.perf_counter()
                call()
                seconds.append(time.perf_counter() - start)
            out[key].append(1e6 * median(seconds))
    return out
