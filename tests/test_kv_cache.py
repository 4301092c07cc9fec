import pytest
import torch

import course_lib
from course_lib.text.context import filler_ids, story_ids
from course_lib.engine.stages import decode_step, prefill
from course_lib.engine.budget import Request, simulate_budget
from course_lib.runner.kv_cache import cache_bytes, kv_bytes_per_token, model_kv_bytes_per_token, positions_processed
from course_lib.measure.speed import cached_run, uncached_run


def test_cached_and_uncached_tokens_are_identical(tiny, tokenizer):
    """A mechanism that holds for any model: on the tiny random one (lesson 07 shows it on the real model)."""
    prompt = story_ids(tokenizer)
    cached, uncached = cached_run(tiny, tokenizer, prompt, 24), uncached_run(tiny, prompt, 24)
    assert cached.token_ids == uncached.token_ids
    assert len(cached.seconds) == len(uncached.seconds) == 24
    assert cached.positions_processed == positions_processed(len(prompt), 24, True)
    assert uncached.positions_processed == positions_processed(len(prompt), 24, False)


def test_positions_formula():
    assert positions_processed(10, 3, True) == 12
    assert positions_processed(10, 3, False) == 10 + 11 + 12
    assert positions_processed(5, 1, False) == positions_processed(5, 1, True) == 5


def test_memory_formula_values(model):
    assert kv_bytes_per_token(30, 3, 64, 2) == 23_040
    assert kv_bytes_per_token(30, 3, 64, 4) == 46_080
    assert model_kv_bytes_per_token(model.config, torch.bfloat16) == 23_040
    assert model_kv_bytes_per_token(model.config, torch.float32) == 46_080


@pytest.mark.parametrize("n", [1, 37, 300])
def test_memory_formula_matches_the_cache_object(model, tokenizer, n):
    _, cache = prefill(model, filler_ids(tokenizer, n))
    assert cache_bytes(cache) == n * model_kv_bytes_per_token(model.config, model.dtype)
    decode_step(model, [5], cache)
    assert cache_bytes(cache) == (n + 1) * model_kv_bytes_per_token(model.config, model.dtype)


def test_bfloat16_cache_memory_halves(tokenizer):
    half, _ = course_lib.load_model(device="cpu", dtype="bfloat16", verbose=False)
    _, cache = prefill(half, filler_ids(tokenizer, 20))
    assert cache_bytes(cache) == 20 * 23_040


TRACE = [Request("A", 0, 60, 80), Request("B", 5, 40, 120), Request("C", 12, 120, 40), Request("D", 20, 30, 60),
         Request("E", 30, 90, 50), Request("F", 45, 50, 40), Request("G", 60, 20, 30)]


@pytest.mark.parametrize("policy", ["reject", "evict", "preempt"])
def test_budget_is_never_exceeded(policy):
    out = simulate_budget(TRACE, 320, policy)
    assert max(out.usage) <= 320
    assert set(out.status) == {r.name for r in TRACE}


def test_policies_differ_as_described():
    reject, evict = simulate_budget(TRACE, 320, "reject"), simulate_budget(TRACE, 320, "evict")
    assert "evicted" not in reject.status.values() and "rejected" in reject.status.values()
    assert "evicted" in evict.status.values()


def test_everything_fits_with_a_big_budget():
    for policy in ("reject", "evict"):
        assert set(simulate_budget(TRACE, 10_000, policy).status.values()) == {"finished"}


def test_bad_policy_and_budget():
    with pytest.raises(ValueError, match="policy"):
        simulate_budget(TRACE, 100, "panic")
    with pytest.raises(ValueError, match="budget"):
        simulate_budget(TRACE, 0, "reject")


def test_preempt_finishes_every_request_and_counts_the_recomputed_work():
    reject, evict, preempt = (simulate_budget(TRACE, 320, p) for p in ("reject", "evict", "preempt"))
    assert preempt.finished == len(TRACE) and set(preempt.status.values()) == {"finished"}
    assert preempt.preempted and preempt.lost > 0  # memory did run out, and the paused work was redone
    assert evict.finished < len(TRACE) and evict.lost > 0 and reject.lost == 0
    assert max(preempt.usage) <= 320


def test_a_budget_that_is_not_a_positive_int_is_refused():
    for bad in (True, 0, 2.5):
        with pytest.raises(ValueError, match="budget"):
            simulate_budget(TRACE, bad, "reject")


def test_reject_reserves_the_allowance_a_server_knows_not_the_true_answer():
    """A server knows max_tokens, not the answer's length: reserving the allowance turns away at least as many as
    reserving the true lengths (the oracle, max_tokens=None), and here strictly more."""
    told = [Request(r.name, r.arrival, r.prompt, r.answer, max_tokens=128) for r in TRACE]
    with_allowance, oracle = simulate_budget(told, 450, "reject"), simulate_budget(TRACE, 450, "reject")
    assert with_allowance.finished < oracle.finished
    assert Request("X", 0, 10, 20).allowance == 20 and Request("X", 0, 10, 20, max_tokens=64).allowance == 64
