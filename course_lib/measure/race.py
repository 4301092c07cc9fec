"""Lesson 11's measurements: the race between the library and our model, and where a decode step's time goes.

What it does: times `generation.generate` on any model against the library's `model.generate`
(same prompt, same greedy tokens, warm-up and best-of timings); measures the milliseconds per
decode step once a long prompt is cached, by the same method for both (the gaps between consecutive
new tokens of one run: ours from the loop's own step records, the library's from a streamer); and profiles one decode step with
torch.profiler, grouping operator self-times into matrix products, attention, norms, cache and
copies, and everything else.
What it does not do: draw (plots_perf.py) or assert a target (the bench reports them).
"""
from __future__ import annotations

import time
from collections import defaultdict

import torch

from ..engine.stages import decode_step, prefill
from ..engine.generation import generate
from ..runtime import median, synchronize
from .timers import TIMING_TOKEN, best_of


def _library_generate(hf_model, prompt_ids: list[int], n_new: int) -> list[int]:
    ids = torch.tensor([prompt_ids], device=hf_model.device)
    with torch.inference_mode():
        out = hf_model.generate(ids, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
                                pad_token_id=hf_model.generation_config.eos_token_id)
    return out[0, len(prompt_ids):].tolist()


def race(ours, hf_model, tokenizer, prompt_ids: list[int], n_new: int = 128, repeats: int = 3) -> dict:
    """Tokens per second of `ours` (any model) under generation.generate against hf_model.generate, greedy,
    exactly n_new tokens on both sides (no early stop). Warmed up, alternating, best of `repeats`; every
    repeat's rate is kept too (`*_runs`), so a figure can show the spread."""
    def theirs():
        return _library_generate(hf_model, prompt_ids, n_new)

    def mine():
        return generate_exact(ours, tokenizer, prompt_ids, n_new)

    generate_exact(ours, tokenizer, prompt_ids, 2), _library_generate(hf_model, prompt_ids, 2)  # warm-up
    ours_runs, theirs_runs = [], []
    for _ in range(repeats):
        t, mine_tokens = best_of(mine, 1, ours.device, warmup=0)
        ours_runs.append(t)
        t, their_tokens = best_of(theirs, 1, hf_model.device, warmup=0)
        theirs_runs.append(t)
    ours_best, theirs_best = min(ours_runs), min(theirs_runs)
    return {"new_tokens": n_new, "tokens_per_s": n_new / ours_best, "generate_tokens_per_s": n_new / theirs_best,
            "ratio": theirs_best / ours_best, "same_tokens": mine_tokens == their_tokens, "token_ids": mine_tokens,
            "tokens_per_s_runs": [n_new / t for t in ours_runs],
            "generate_tokens_per_s_runs": [n_new / t for t in theirs_runs]}


def generate_exact(model, tokenizer, prompt_ids: list[int], n_new: int) -> list[int]:
    """generation.generate with no end-of-turn stop, so it makes exactly n_new tokens (as
    model.generate(min_new_tokens=n_new) does). The same loop and stages as every lesson."""
    return generate(model, tokenizer, prompt_ids, n_new, stop_ids=()).token_ids


class _Stamps:
    """A transformers streamer that only records when each token arrived (put is called once per token)."""

    def __init__(self, device):
        self.device, self.at = device, []

    def put(self, value):
        synchronize(self.device)
        self.at.append(time.perf_counter())

    def end(self):
        pass


def library_step_seconds(hf_model, prompt_ids: list[int], n_new: int) -> list[float]:
    """Seconds between consecutive new tokens of hf_model.generate (one decode step each), via a streamer."""
    stamps = _Stamps(hf_model.device)
    ids = torch.tensor([prompt_ids], device=hf_model.device)
    with torch.inference_mode():
        hf_model.generate(ids, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False, streamer=stamps,
                          pad_token_id=hf_model.generation_config.eos_token_id)
    at = stamps.at[1:]  # note: the first put is the prompt itself
    return [b - a for a, b in zip(at, at[1:])]


def our_step_seconds(model, tokenizer, prompt_ids: list[int], n_new: int) -> list[float]:
    """Seconds between consecutive new tokens of generation.generate (one decode step and one pick each)."""
    return generate(model, tokenizer, prompt_ids, n_new, stop_ids=()).inter_token_seconds


def long_context(ours, hf_model, tokenizer, prompt_ids: list[int], k: int = 16) -> dict:
    """Decode milliseconds per token after a long prompt: ours (generation.generate on our cache) against the
    library's own model.generate (its prefill, then its cache growing by concatenation). Both measured the
    same way: the gaps between consecutive tokens of one run (prefill excluded), median of k gaps."""
    mine = median(our_step_seconds(ours, tokenizer, prompt_ids, k + 1)) * 1000
    theirs = median(library_step_seconds(hf_model, prompt_ids, k + 1)) * 1000
    return {"context": len(prompt_ids), "ms_per_token": mine, "generate_ms_per_token": theirs,
            "ratio": theirs / mine if mine > 0 else float("nan")}


GROUPS = {
    "matrix products": ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul", "aten::_weight_int"),
    "attention": ("aten::_scaled_dot_product", "aten::scaled_dot_product", "aten::_flash_attention", "aten::softmax",
                  "aten::_softmax", "aten::baddbmm"),
    "norms": ("aten::rsqrt", "aten::pow", "aten::mean", "aten::rms_norm", "aten::_fused_rms_norm"),
    "cache and copies": ("aten::copy_", "aten::cat", "aten::index", "aten::slice", "aten::narrow", "aten::fill_",
                         "aten::zeros", "aten::empty", "aten::clone", "aten::contiguous", "aten::_to_copy"),
}


def group_of(op_name: str) -> str:
    """Which of GROUPS an operator belongs to. Example: "aten::addmm" -> "matrix products" """
    for group, prefixes in GROUPS.items():
        if op_name.startswith(prefixes):
            return group
    return "everything else"


@torch.inference_mode()
def decode_profile(model, prompt_ids: list[int], steps: int = 4) -> dict:
    """Profile `steps` decode steps after prompt_ids is cached. Returns milliseconds per step by group, the
    operators counted per step, and the wall time per step."""
    from torch.profiler import ProfilerActivity, profile
    logits, cache = prefill(model, prompt_ids, capacity=len(prompt_ids) + steps + 2)
    decode_step(model, [TIMING_TOKEN], cache)  # warm-up
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if model.device.type == "cuda" else [])
    synchronize(model.device)
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            decode_step(model, [TIMING_TOKEN], cache)
        synchronize(model.device)
    wall = (time.perf_counter() - start) / steps
    groups: dict[str, float] = defaultdict(float)
    calls = 0
    for event in prof.key_averages():
        groups[group_of(event.key)] += event.self_cpu_time_total / 1000 / steps  # ms per step
        if event.key.startswith("aten::"):
            calls += event.count
    aten = [e for e in prof.events() if e.name.startswith("aten::")]
    from_python = sum(1 for e in aten if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))
    return {"context": len(prompt_ids), "ms_by_group": dict(groups), "aten_calls_per_step": calls / steps,
            "python_calls_per_step": from_python / steps, "wall_ms_per_step": 1000 * wall}


@torch.inference_mode()
def step_anatomy(model, prompt_ids: list[int], steps: int = 30) -> dict:
    """One decode step at batch 1 split into what can be named, in milliseconds: the whole step (median of
    `steps`, no profiler), the step's matrix products when each is called alone on one row (the weights' read:
    the same objects, the same order), and the rest (attention over the cache, norms, rotary, cache writes, and
    calling each operator from Python). Also the operators per step as torch.profiler counts them (nested ones
    included, as lesson 11's profile counts) and the calls Python makes (the top-level ones), and what one tiny
    operator costs to call (so calls x cost estimates the calling overhead)."""
    _, cache = prefill(model, prompt_ids, capacity=len(prompt_ids) + steps + 8)
    for _ in range(3):
        decode_step(model, [TIMING_TOKEN], cache)  # warm-up
    gaps = []
    for _ in range(steps):
        synchronize(model.device)
        start = time.perf_counter()
        decode_step(model, [TIMING_TOKEN], cache)
        synchronize(model.device)
        gaps.append(time.perf_counter() - start)
    linears = model.linears()
    rows = {k: torch.randn(1, 1, k, dtype=model.dtype, device=model.device) for k in {m.in_features for m in linears}}

    def products():
        for m in linears:
            m(rows[m.in_features])
    products_s, _ = best_of(products, repeats=max(3, steps // 5), device=model.device)
    a, b = torch.ones(4, device=model.device), torch.ones(4, device=model.device)
    tiny = best_of(lambda: [torch.add(a, b) for _ in range(1000)], repeats=5, device=model.device)[0] / 1000
    counted = decode_profile(model, prompt_ids, steps=2)
    step_ms, products_ms = 1000 * median(gaps), 1000 * products_s
    return {"step_ms": step_ms, "products_ms": products_ms, "rest_ms": step_ms - products_ms,
            "aten_ops": counted["aten_calls_per_step"], "python_calls": counted["python_calls_per_step"],
            "tiny_call_us": 1e6 * tiny, "calling_ms_estimate": counted["python_calls_per_step"] * tiny * 1000}


def layout_gains(model) -> list[dict]:
    """For each kind of matrix in a decode step (layer 0's four and the head): its shape, how many times
    faster one token's product reads it stored by columns than by rows on this machine (layout.layout_gain,
    caches emptied), the layout the model holds it in, and for five rows at once how many times faster
    oneDNN is than MKL on it as held (layout.several_rows_gain; None without oneDNN) and the kernel used."""
    from ..runner.layout import layout_gain, onednn_available, several_rows_gain
    layer = model.layers[0]
    rows = []
    for name, linear in [("q|k|v", layer.qkv), ("o", layer.o), ("gate|up", layer.gate_up), ("down", layer.down),
                         ("head", model.lm_head)]:
        several = several_rows_gain(linear.weight) if onednn_available() and linear.weight.device.type == "cpu" else None
        rows.append({"matrix": name, "shape": tuple(linear.weight.shape), "gain": layout_gain(linear.weight),
                     "layout": linear.layout, "several_rows_gain": several, "kernel": linear.kernel})
    return rows
