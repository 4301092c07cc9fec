"""The roofline's parts (lessons 08 and 12): work per step, placing a step, the probes' sizes, and copies
that really are copies."""
import pytest
import torch
from types import SimpleNamespace

from course_lib.measure import memory, roofline

CFG = SimpleNamespace(num_hidden_layers=30, num_attention_heads=9, hidden_size=576, head_dim=64)


def test_decode_work_counts_weights_attention_and_cache():
    w = roofline.step_work(CFG, 2e8, 5e8, 46_080, new_tokens=1, context=1000)
    assert w["attention_flops"] == 4 * 30 * 9 * 64 * 1001  # one token against 1,000 cached keys and itself
    assert w["flops"] == 2e8 + w["attention_flops"]
    assert w["bytes"] == 5e8 + 46_080 * 1001  # weights, the cache read, the new token written


def test_prefill_work_is_causal():
    w = roofline.step_work(CFG, 2e8, 5e8, 46_080, new_tokens=4, context=0)
    assert w["attention_flops"] == 4 * 30 * 9 * 64 * (1 + 2 + 3 + 4)
    assert w["flops"] == pytest.approx(4 * 2e8 + w["attention_flops"])


def test_place_picks_the_binding_ceiling():
    peak, bw = 200e9, 20e9  # ridge at 10 FLOP/byte
    low = roofline.place({"flops": 1e9, "bytes": 2e9}, 0.2, peak, bw)  # 0.5 FLOP/byte
    assert low["bound"] == "memory" and low["roof"] == pytest.approx(10e9) and low["ridge"] == 10
    assert low["of_roof"] == pytest.approx(5e9 / 10e9)
    high = roofline.place({"flops": 1e12, "bytes": 1e9}, 10.0, peak, bw)  # 1,000 FLOP/byte
    assert high["bound"] == "compute" and high["roof"] == peak and high["of_roof"] == pytest.approx(0.5)


def test_probe_is_two_caches_or_a_gib(monkeypatch):
    monkeypatch.setattr(roofline, "last_level_cache_bytes", lambda: 32 * 2**20)
    assert roofline.probe_bytes() == 2**30
    monkeypatch.setattr(roofline, "last_level_cache_bytes", lambda: 960 * 2**20)
    assert roofline.probe_bytes() == 2 * 960 * 2**20
    monkeypatch.setattr(roofline, "last_level_cache_bytes", lambda: None)
    assert roofline.probe_bytes() == 2**30


def test_cache_sizes_are_parsed(tmp_path, monkeypatch):
    for i, size in enumerate(["48K", "2048K", "32M"]):
        (tmp_path / f"index{i}").mkdir()
        (tmp_path / f"index{i}" / "size").write_text(size + "\n")
    real = roofline.Path
    monkeypatch.setattr(roofline, "Path", lambda p: tmp_path if "cache" in str(p) else real(p))
    assert roofline.last_level_cache_bytes() == 32 * 2**20


def test_compute_ceiling_is_a_rate():
    torch.manual_seed(0)
    rate = roofline.compute_ceiling(torch.float32, n=128, repeats=2)
    assert 1e8 < rate < 1e14  # FLOP/s of any CPU or GPU, not seconds nor FLOPs


@pytest.mark.parametrize("name", ["float32", "int8"])
def test_kernel_probe_copies_each_have_their_own_memory(name):
    layers = memory.layer_copies(name, [(64, 64), (32, 64)], megabytes=1)
    storage = [(layer.weight if name == "float32" else layer.q).untyped_storage().data_ptr() for layer in layers]
    assert len(set(storage)) == len(layers)  # a shared tensor would be read from the cache, not from memory
    assert sum(layer.nbytes for layer in layers) >= 2**20
