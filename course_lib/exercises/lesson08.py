"""Checks for 08_prefill_decode: achieved bandwidth, the context where the cache outweighs the weights,
a measured prefill/decode speed ratio, and a prediction of a long prompt's prefill, measured after."""
from __future__ import annotations

from ..measure.prefill_decode import decode_seconds, prefill_seconds
from . import check_prediction, fresh, off, safely, verdict


def check_bandwidth(achieved_bandwidth) -> bool:
    """achieved_bandwidth(weight_bytes, seconds_per_token) -> bytes per second read during decode."""
    rng = fresh()
    cases = [(538_060_032, 0.05), (1, 1)] + [(rng.randint(10**6, 10**11), rng.uniform(0.001, 2.0)) for _ in range(3)]
    for case in cases:
        ok, got = safely(achieved_bandwidth, *case)
        if not ok:
            return verdict(False, "", got)
        want = case[0] / case[1]
        if not isinstance(got, (int, float)) or abs(got - want) > 1e-6 * want:
            return verdict(False, "", f"for {case} you returned {got!r}, {off(got, want)}. Hint: every weight is "
                           "read once per decode step")
    return verdict(True, "bytes read per step divided by seconds per step", "")


def check_crossover(crossover_context) -> bool:
    """crossover_context(weight_bytes, kv_bytes_per_token, batch) -> the context, in tokens per row, at which one
    decode step of a batch of `batch` rows reads as many cache bytes as weight bytes (an int, rounded down). The
    weights are read once per step for the whole batch; each row reads its own cache."""
    rng = fresh()
    cases = [(538_060_032, 46_080, 1), (538_060_032, 46_080, 16)]
    cases += [(rng.randint(10**8, 10**11), rng.randint(10**3, 10**6), rng.choice([1, 2, 4, 8, 32, 64])) for _ in range(3)]
    for case in cases:
        ok, got = safely(crossover_context, *case)
        if not ok:
            return verdict(False, "", got)
        want = int(case[0] // (case[1] * case[2]))
        if got != want or not isinstance(got, int):
            return verdict(False, "", f"for {case} you returned {got!r}, {off(got, want)}. Hint: per step, the "
                           "weights once, plus every row's cache; an int, rounded down")
    return verdict(True, "past that context per row, a step reads more cache than weights; a bigger batch gets "
                   "there sooner", "")


def measure_phase_ratio(model, tokenizer, n: int = 256) -> float:
    """Prefill tokens/s at n prompt tokens divided by decode tokens/s at n tokens of context, measured now."""
    prefill_tps = n / prefill_seconds(model, tokenizer, [n])[0]
    decode_tps = 1 / decode_seconds(model, tokenizer, [n])[0]
    return prefill_tps / decode_tps


def check_phase_ratio(ratio, model, tokenizer, n: int = 256, tolerance: float = 2.5,
                      reference: float | None = None) -> bool:
    """ratio: prefill tokens/s at n prompt tokens divided by decode tokens/s at n tokens of context;
    accepted within a factor `tolerance` of a rerun (or of `reference`, measured earlier)."""
    if not isinstance(ratio, (int, float)) or ratio <= 0:
        return verdict(False, "", "give the ratio as a positive number")
    rerun = reference if reference is not None else measure_phase_ratio(model, tokenizer, n)
    ok = rerun / tolerance <= ratio <= rerun * tolerance
    return verdict(ok, f"your {ratio:.1f}x agrees with the rerun's {rerun:.1f}x: prefill is that much faster per token",
                   f"your {ratio!r} is more than a factor {tolerance} away from the check's own rerun. Measure both "
                   "with prefill_seconds and decode_seconds at the same n, then divide tokens per second")


def check_ttft_prediction(prediction_s, model, tokenizer, n: int = 2000, tolerance: float = 1.5) -> bool:
    """prediction_s: your prediction, written BEFORE this runs, of the seconds to prefill an n-token prompt on this
    machine (from section 1's curve). The check then measures it (best of 2) and accepts a factor `tolerance`."""
    return check_prediction(prediction_s, lambda: prefill_seconds(model, tokenizer, [n], repeats=2)[0], unit="s",
                            what=f"to prefill {n} tokens", tolerance=tolerance,
                            timed=True, hint="Did you extrapolate tokens per second from the longest prompt of section 1? "
                                 "Attention's cost grows faster than the prompt")
