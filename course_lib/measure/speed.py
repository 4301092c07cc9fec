"""Speed experiments on the engine's stages: lesson 07's runs with and without a cache, lesson 14's verify cost.

What it does: `cached_run` times generation.generate (the one loop) token by token, with no stop token;
`uncached_run` is lesson 07's deliberate baseline: every step re-runs the whole sequence through
forward.run_model with no cache (the one loop that is not the engine's, on purpose: it is what the cache
saves); `verify_cost` times one pass over k + 1 new positions on a cache that is rolled back after each pass;
`throughput_latency` times static batches of several sizes (lesson 09).
What it does not do: change what the engine computes (the same tokens either way: tests check it).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..engine.request import check_request, Job
from ..engine.generation import generate, run_schedule
from ..runner.forward import run_model
from ..engine.stages import prefill
from ..runner.kv_cache import length_of, positions_processed, rollback
from ..engine.sampling import greedy
from ..runtime import median, progress
from .timers import TIMING_TOKEN, Stopwatch, best_of


@dataclass
class TimedRun:
    """Greedy tokens and the seconds each new token took (the first includes the prompt's pass)."""
    cached: bool
    token_ids: list[int]
    seconds: list[float]
    positions_processed: int  # token positions pushed through the model in total

    @property
    def total(self) -> float:
        return sum(self.seconds)


def cached_run(model, tokenizer, prompt_ids, n_new: int) -> TimedRun:
    """The loop (generation.generate), greedy, no stop token: exactly n_new tokens. Each token's time is the
    forward pass that produced its logits plus the pick (the first: prefill); read from the Steps' stamps."""
    result = generate(model, tokenizer, prompt_ids, n_new, stop_ids=())
    at = [s.at for s in result.steps]
    seconds = [at[0]] + [b - a for a, b in zip(at, at[1:])]
    return TimedRun(True, result.token_ids, seconds, positions_processed(len(result.prompt_ids), n_new, True))


@torch.inference_mode()
def uncached_run(model, prompt_ids, n_new: int, show_progress: bool = False) -> TimedRun:
    """Every step re-runs the whole sequence so far: what generation would cost with no KV cache.
    show_progress: a bar over the steps (a lesson's long run)."""
    ids = check_request(model, prompt_ids, n_new)
    run = TimedRun(False, [], [], 0)
    seq = torch.tensor([ids], device=model.device)  # (1, T), grows by one each step
    for _ in (progress(range(n_new), "steps without the cache") if show_progress else range(n_new)):
        watch = Stopwatch(model.device)
        logits, _ = run_model(model, seq, None, keep=1)  # (1, 1, V); no cache, on purpose
        token, _ = greedy(logits[0, -1])
        run.positions_processed += seq.shape[1]
        seq = torch.cat([seq, torch.tensor([[token]], device=model.device)], dim=1)
        run.seconds.append(watch.seconds())
        run.token_ids.append(token)
    return run


@torch.inference_mode()
def verify_cost(model, prompt_ids: list[int], ks: list[int], repeats: int = 5) -> dict[int, float]:
    """Milliseconds of one pass over k + 1 new positions on a cache holding prompt_ids (k = 0: a plain decode
    step), best of `repeats`; the cache is rolled back after each pass, so every pass sees the same context."""
    _, cache = prefill(model, prompt_ids, capacity=len(prompt_ids) + max(ks) + 2)
    start, out = length_of(cache), {}
    for k in ks:
        ids = torch.full((1, k + 1), TIMING_TOKEN, device=model.device)  # (1, k + 1)

        def one_pass():
            run_model(model, ids, cache, keep=k + 1)
            rollback(cache, start)

        out[k] = best_of(one_pass, repeats, model.device)[0] * 1000
    return out


def throughput_latency(model, prompt: list[int], batch_sizes: list[int], new_tokens: int,
                       repeats: int = 1) -> list[dict]:
    """The same prompt B times in one static batch, exactly new_tokens each: aggregate tokens per second
    and the latency every request sees (they all finish together). With repeats > 1, every size is run that
    many times, round after round, and the median is reported, each run kept in `seconds_runs`."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    runs: dict[int, list[float]] = {size: [] for size in batch_sizes}
    for _ in range(repeats):
        for size in batch_sizes:
            jobs = [Job(f"r{i}", prompt, new_tokens) for i in range(size)]
            start = time.perf_counter()
            run_schedule(model, jobs, size, continuous=False)
            runs[size].append(time.perf_counter() - start)
    rows = []
    for size in batch_sizes:
        seconds = median(runs[size])
        rows.append({"batch": size, "new_tokens": new_tokens, "seconds": seconds,
                     "tokens_per_s": size * new_tokens / seconds, "latency_s": seconds, "seconds_runs": runs[size]})
    return rows
