"""The compiled step measured (issue: the course's engine as fast as llama.cpp): the engine's own decode step
against the static-shape step run eagerly and compiled, per weight format, one row.

What it does: `timed_static_run` (greedy tokens and each step's seconds through a StaticStep), `compiled_decode`
(the peers' bare loop through a freshly compiled step: tokens per second and the compile time), `compiled_comparison`
(for float32 and, on the CPU, the int4 format: ms per step of the three, operators per step, the compile time, and
whether the tokens are the engine's own); the bench's `engine.compiled`.
What it does not do: decide anything for the engine (the numbers are reported; lesson 11 reads them).
"""
from __future__ import annotations


import torch

from ..runtime import median
from ..runner.static_step import StaticStep, compile_available
from .race import generate_exact, our_step_seconds
from .timers import greedy_gaps


def timed_static_run(step: StaticStep, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """n greedy tokens through `step` after its prefill; the seconds of each gap, the argmax included
    (timers.greedy_gaps, as bare_decode and llama.cpp's side are timed)."""
    return greedy_gaps(step, step.prefill(prompt), n, step.model.device)


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
    over its masked span of the cache adds in another order than the engine's over the written columns, so a near-tie
    can flip (first_difference says where)."""
    from ..runner.formats import convert
    formats = {"float32": ours}
    if ours.device.type == "cpu":
        formats["int4"] = convert(ours, "int4")
    capacity = len(prompt) + n + 1
    can, why = compile_available()
    result = {"what": f"one row's decode step at static shapes (a {capacity}-column cache read up to its span, "
                      "with a mask; "
                      "the position as a tensor), torch.compile(dynamic=False, freezing, cpp_wrapper) on "
                      f"{ours.device.type}; "
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


PARTS = ("layer_products", "head", "attention", "loop", "rest")  # step_parts' split of a step, in this order


@torch.inference_mode()
def step_parts(model, prompt_ids: list[int], n_new: int = 64) -> dict:
    """Where one compiled decode step's milliseconds go, one row, at the current thread count (the issue asks for
    each millisecond against llama.cpp's). ms: `step`, the median gap of the peers' bare loop through a freshly
    compiled StaticStep (the argmax included); `layer_products`, every layer's matrix product called alone from
    Python in the step's order (the same objects, one row each); `head`, the output head alone; `attention`, each
    layer's attention alone over the step's cache with its mask; `loop`, the loop's own work (the argmax of the
    logits, the token and position made tensors); `rest`, the step minus those four (the generated kernels:
    norms, rotary, residual adds, silu, cache writes; entering the compiled code). The head is timed right after
    the layers' products, as a step reads it. Also the bytes each part reads, the machine's streaming read
    (memory.read_bandwidth) and so `read_floor_ms`, the time the weights' bytes take at that rate: no engine's
    step on this file can be shorter than its read."""
    import math

    import torch.nn.functional as F

    from .memory import read_bandwidth
    from .timers import best_of
    capacity = len(prompt_ids) + n_new + 1
    step = fresh_compiled_step(model, capacity)
    _, seconds = timed_static_run(step, prompt_ids, n_new)
    layer_linears = model.linears()[:-1]
    rows = {k: torch.randn(1, 1, k, dtype=model.dtype, device=model.device)
            for k in {m.in_features for m in layer_linears}}
    x = torch.randn(1, 1, model.lm_head.in_features, dtype=model.dtype, device=model.device)
    products_s, _ = best_of(lambda: [m(rows[m.in_features]) for m in layer_linears], repeats=5, device=model.device)
    # note: the head is timed after the layers' products, as the step reads it (alone and repeated, its 28 MB
    # would stay in the caches and read faster than it does in a step)
    weights_s, _ = best_of(lambda: ([m(rows[m.in_features]) for m in layer_linears], model.lm_head(x)), repeats=5,
                           device=model.device)
    logits = model.lm_head(x)[0, -1]  # (V,)
    loop_s, _ = best_of(lambda: (torch.tensor([[int(logits.argmax())]]), torch.tensor([0])), repeats=20,
                        device=model.device)
    groups, D = model.heads // model.kv_heads, model.head_dim
    q = torch.randn(1, model.kv_heads, groups, D, dtype=model.dtype, device=model.device)
    seen = (torch.arange(capacity, device=model.device) < capacity - 1)[None, None, None].expand(1, 1, groups, capacity)
    keys, values = step.cache.keys, step.cache.values
    attention_s, _ = best_of(lambda: [F.scaled_dot_product_attention(q, k, v, attn_mask=seen)
                                      for k, v in zip(keys, values)], repeats=5, device=model.device)
    bandwidth = read_bandwidth()
    weight_bytes = model.weight_bytes()
    ms = {"step": 1000 * median(seconds[1:]), "layer_products": 1000 * products_s,
          "head": 1000 * (weights_s - products_s), "attention": 1000 * attention_s, "loop": 1000 * loop_s}
    ms["rest"] = ms["step"] - sum(ms[part] for part in PARTS if part != "rest")
    return {"threads": torch.get_num_threads(), "context": capacity, "ms": ms,
            "bytes": {"layer_products": sum(m.nbytes for m in layer_linears), "head": model.lm_head.nbytes,
                      "attention": sum(k.numel() * k.element_size() * 2 for k in keys), "weights": weight_bytes},
            "read_bytes_per_s": bandwidth, "read_floor_ms": 1000 * weight_bytes / bandwidth,
            "compile_s": step.compile_seconds, "tokens_per_s": 1000 / ms["step"] if ms["step"] > 0 else math.nan}
