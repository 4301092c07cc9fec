"""Checks for 07_kv_cache: the memory formula, the uncached work count, and a measured speed-up ratio, and
a decode step at a long context predicted before it is measured."""
from __future__ import annotations

from ..runner.kv_cache import cache_bytes, kv_bytes_per_token, positions_processed
from ..measure.speed import cached_run, uncached_run
from ..measure.prefill_decode import decode_timings
from . import check_prediction, fresh, off, safely, verdict


def check_kv_bytes(kv_bytes, model) -> bool:
    """kv_bytes(tokens, layers, kv_heads, head_dim, bytes_per_number) -> bytes the cache holds."""
    from ..engine.stages import prefill
    rng = fresh()
    cases = [(1, 30, 3, 64, 2), (0, 30, 3, 64, 4)]
    cases += [(rng.randint(1, 200_000), rng.choice([2, 16, 30, 32, 80]), rng.choice([1, 3, 8]), rng.choice([64, 128]),
               rng.choice([1, 2, 4])) for _ in range(3)]
    for case in cases:
        ok, got = safely(kv_bytes, *case)
        if not ok:
            return verdict(False, "", got)
        want = case[0] * kv_bytes_per_token(*case[1:])
        if got != want:
            return verdict(False, "", f"for {case} you returned {got!r}, {off(got, want)}. Hint: one key and one "
                           "value vector per token, per layer, per KV head")
    _, cache = prefill(model, list(range(100, 140)))
    cfg = model.config
    got = kv_bytes(40, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, model.dtype.itemsize)
    return verdict(got == cache_bytes(cache), f"and it equals the {cache_bytes(cache):,} bytes of a real 40-token cache",
                   f"your formula gives {got!r} for a real cache holding {cache_bytes(cache):,} bytes")


def check_positions(positions_without_cache) -> bool:
    """positions_without_cache(prompt_len, n_new) -> total positions processed with no KV cache."""
    rng = fresh()
    for case in [(10, 1), (10, 3)] + [(rng.randint(1, 500), rng.randint(2, 1000)) for _ in range(3)]:
        ok, got = safely(positions_without_cache, *case)
        if not ok:
            return verdict(False, "", got)
        want = positions_processed(*case, cached=False)
        if got != want:
            return verdict(False, "", f"for prompt {case[0]}, {case[1]} new tokens you returned {got!r}, "
                           f"{off(got, want)}. Hint: step i re-runs prompt_len + i positions, for i = 0 .. n_new - 1")
    return verdict(True, "a sum of growing lengths: quadratic in n_new, not exponential", "")


def measure_ratio(model, tokenizer, prompt_ids, n_new: int = 48) -> float:
    """Uncached time / cached time for n_new greedy tokens, measured now."""
    return uncached_run(model, prompt_ids, n_new).total / cached_run(model, tokenizer, prompt_ids, n_new).total


def check_ratio(ratio, model, tokenizer, prompt_ids, n_new: int = 48, tolerance: float = 2.0, reference: float | None = None) -> bool:
    """ratio: uncached time / cached time for n_new tokens; accepted within a factor `tolerance` of a rerun
    (or of `reference`, a ratio measured earlier in the same conditions)."""
    if not isinstance(ratio, (int, float)) or ratio <= 0:
        return verdict(False, "", "give the ratio as a positive number (uncached seconds / cached seconds)")
    rerun = reference if reference is not None else measure_ratio(model, tokenizer, prompt_ids, n_new)
    ok = rerun / tolerance <= ratio <= rerun * tolerance
    return verdict(ok, f"your {ratio:.2f}x agrees with the rerun's {rerun:.2f}x",
                   f"your {ratio!r} is more than a factor {tolerance} away from the check's own rerun. Time both runs "
                   "(uncached_run and cached_run, same prompt and n_new) and divide the uncached total by the cached total")


def check_long_step_prediction(prediction_ms, model, tokenizer, context: int = 3000, tolerance: float = 1.4) -> bool:
    """prediction_ms: your prediction, written BEFORE this runs, of the milliseconds of one cached decode step once
    the cache holds `context` tokens (section 2's plot showed steps at a few hundred). The check measures it: the
    median of 8 steps on a fresh cache, measured again on a near miss (check_prediction's timed=True)."""
    return check_prediction(prediction_ms, lambda: decode_timings(model, tokenizer, [context])[0].median * 1000,
                            unit="ms",
                            what=f"per decode step at {context:,} tokens of context", tolerance=tolerance,
                            timed=True, hint="A step reads all the weights whatever the context, plus the cache, which grows "
                                 "with it: compare the cache's bytes at that context (section 4) with the weights'")
