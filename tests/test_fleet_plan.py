"""The fleet calculator of lesson 18: its arithmetic, its choice, its refusals (pure Python, no model)."""
from dataclasses import replace

import pytest

from course_lib.serve.fleet_plan import H100_SXM, LLAMA_70B, Workload, curve, decode_step_s, plan

WORK = Workload(rate=10, prompt_tokens=2000, output_tokens=300, ttft_s=1.0, itl_s=0.05)


def test_the_cache_per_token_of_a_70b_model():
    assert LLAMA_70B.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2  # keys and values, layers, KV heads, dims, bf16


def test_the_plan_meets_its_targets_with_the_fewest_devices():
    p = plan(LLAMA_70B, H100_SXM, WORK)
    assert p["batch"] == min(p["batch_by_memory"], p["batch_by_latency"]) >= 1
    assert p["decode_step_ms"] <= WORK.itl_s * 1000
    assert p["tokens_per_s_per_replica"] * p["decode_replicas"] >= WORK.rate * WORK.output_tokens
    assert p["decode_devices"] == min(o["decode_devices"] for o in p["options"])
    assert p["weights_gb_per_device"] * p["tp"] == pytest.approx(p["weights_gb"])
    assert all(o["tp"] * H100_SXM.memory_gb * WORK.memory_fraction > p["weights_gb"] for o in p["options"])
    assert p["kv_link_gbs"] == pytest.approx(WORK.rate * WORK.prompt_tokens * LLAMA_70B.kv_bytes_per_token / 1e9)
    assert set(p["inputs"]) == {"model", "device", "workload"}


def test_more_traffic_never_needs_fewer_devices_and_4_bits_never_more():
    devices = [p["devices"] for p in curve(LLAMA_70B, H100_SXM, WORK, [1, 4, 16, 64])]
    assert devices == sorted(devices) and devices[-1] > devices[0]
    int4 = replace(LLAMA_70B, weight_bytes=0.5)
    assert plan(int4, H100_SXM, WORK)["decode_devices"] <= plan(LLAMA_70B, H100_SXM, WORK)["decode_devices"]


def test_a_bigger_batch_never_steps_faster():
    steps = [decode_step_s(LLAMA_70B, H100_SXM, WORK, 4, b) for b in (1, 16, 256, 4096)]
    assert steps == sorted(steps)


def test_targets_no_machine_meets_and_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="pipeline parallelism"):
        plan(LLAMA_70B, H100_SXM, replace(WORK, itl_s=0.001))
    with pytest.raises(ValueError, match="rate must be a positive number"):
        plan(LLAMA_70B, H100_SXM, replace(WORK, rate=0))
    with pytest.raises(ValueError, match="itl_s"):
        plan(LLAMA_70B, H100_SXM, replace(WORK, itl_s=float("nan")))
