"""The compiled step measured (issue: the course's engine as fast as llama.cpp): the engine's own decode step
against the static-shape step run eagerly and compiled, per weight format, one row.

What it does: `timed_static_run` (greedy tokens and each step's seconds through a StaticStep), `compiled_decode`
(the peers' bare loop through a freshly compiled step: tokens per second and the compile time), `compiled_comparison`
(for float32 and, on the CPU, the int4 format: ms per step of the three, operators per step, the compile time, and
whether the tokens are the engine's own); the bench's `engine.compiled`.
What it does not do: decide anything for the engine (the numbers are reported; lesson 11 reads them).
"""
from __future__ import annotations

import time

import torch

from ..runtime import synchronize
from ..static_step import StaticStep, compile_available
from .race import generate_exact, our_step_seconds
from .timers import median


def timed_static_run(step: StaticStep, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """n greedy tokens through `step` after its prefill; the seconds of each step (the pick included, as in the
    engine's own step times)."""
    logits, tokens, seconds = step.prefill(prompt), [], []
    for _ in range(n):
        tokens.append(int(logits.argmax()))
        synchronize(step.model.device)
        start = time.perf_counter()
        logits = step(tokens[-1])
        synchronize(step.model.device)
        seconds.append(time.perf_counter() - start)
    return tokens, seconds


def step_ops(step: StaticStep, prompt: list[int], steps: int = 3) -> float:
    """Operators per decode step as torch.profiler counts them (every aten:: event, nested ones included, as
    race.decode_profile counts the engine's step), over `steps` steps after a warm-up of two."""
    from torch.profiler import ProfilerActivity, profile
    logits = step.prefill(prompt)
    for _ in range(2):
        logits = step(int(logits.argmax()))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            logits = step(int(logits.argmax()))
    return sum(1 for e in prof.events() if e.name.startswith("aten::")) / steps


def fresh_compiled_step(model, capacity: int) -> StaticStep:
    """A StaticStep compiled afresh: torch.compile's kernels are built for the thread count they were compiled at,
    so the ones built earlier (at another count, or for another format) are dropped first."""
    torch._dynamo.reset()
    return StaticStep(model, capacity, compile=True)


def compiled_decode(model, prompt_ids: list[int], n_new: int) -> dict:
    """The bare loop of measure.peers (argmax fed back) through a freshly compiled StaticStep: tokens per second
    from the median gap (the first step, which compiles, left out), the compile time, and the greedy tokens."""
    step = fresh_compiled_step(model, len(prompt_ids) + n_new + 1)
    tokens, seconds = timed_static_run(step, prompt_ids, n_new)
    return {"tokens": tokens, "tokens_per_s": 1 / median(seconds[1:]), "compile_s": step.compile_seconds}


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where two token lists differ (the shorter one's end counts), or None when equal."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def compiled_comparison(ours, tokenizer, prompt: list[int], n: int, compile: bool = True) -> dict:
    """Milliseconds per decode step (the median of n) of the engine's step, the static step eagerly and the static
    step compiled (its first step, which compiles, left out and reported as compile_s), for float32 and, on the
    CPU, the int4 format. compile=False (or no C++ compiler) measures the first two only and says why. Tokens are
    compared with the engine's greedy ones: in bfloat16 (the int4 format's activations) the static step's attention
    over the whole masked cache adds in another order than the engine's over the written columns, so a near-tie
    can flip (first_difference says where)."""
    from ..formats import convert
    formats = {"float32": ours}
    if ours.device.type == "cpu":
        formats["int4"] = convert(ours, "int4")
    capacity = len(prompt) + n + 1
    can, why = compile_available()
    result = {"what": f"one row's decode step at static shapes (a {capacity}-column cache read whole, with a mask; "
                      f"the position as a tensor), torch.compile(dynamic=False, freezing) on {ours.device.type}; "
                      "compile_s is the first call's (torch keeps compiled code in an on-disk cache, so a repeat "
                      "on the same machine compiles faster)",
              "compiled": compile and can, "why_not": "" if compile and can else (why or "not asked (--quick)"),
              "new_tokens": n, "formats": {}}
    for name, model in formats.items():
        want = generate_exact(model, tokenizer, prompt, n)
        our_step_seconds(model, tokenizer, prompt, 3)  # warm-up
        engine_ms = 1000 * median(our_step_seconds(model, tokenizer, prompt, n + 1))
        eager = StaticStep(model, capacity)
        eager_tokens, eager_s = timed_static_run(eager, prompt, n)
        row = {"engine_ms": engine_ms, "static_eager_ms": 1000 * median(eager_s),
               "static_eager_ops_per_step": step_ops(eager, prompt),
               "static_eager_same_tokens": eager_tokens == want,
               "static_eager_first_difference": first_difference(eager_tokens, want)}
        if result["compiled"]:
            step = fresh_compiled_step(model, capacity)
            tokens, seconds = timed_static_run(step, prompt, n)
            compiled_ms = 1000 * median(seconds[1:])
            row |= {"compile_s": step.compile_seconds, "compiled_ms": compiled_ms, "speedup": engine_ms / compiled_ms,
                    "compiled_ops_per_step": step_ops(step, prompt),
                    "compiled_same_tokens": tokens == want, "compiled_first_difference": first_difference(tokens, want)}
        result["formats"][name] = row
    return result
