"""Lesson 12's quality experiment: the file read byte by byte, every tensor checked against it, and rounding
further than the file did (round_trip, requantized)."""
import struct

import numpy as np
import pytest
import torch

from course_lib.runner import formats
from course_lib.measure import gguf_file, quality
from course_lib.runner.model import Model


@pytest.fixture(scope="module")
def ours(model):
    return Model.from_transformers(model)


def test_a_raw_block_decodes_as_the_format_says():
    raw = gguf_file.raw_block("blk.0.ffn_down.weight", 3, 5)
    b = raw["bytes"]
    assert raw["type"] == "Q4_1" and len(b) == 20
    scale, low = struct.unpack("<ee", b[:4])  # two little-endian float16
    q = [x & 0xF for x in b[4:]] + [x >> 4 for x in b[4:]]
    assert raw["q"] == q and raw["scale"] == pytest.approx(scale) and raw["minimum"] == pytest.approx(low)
    assert raw["weights"] == pytest.approx([v * scale + low for v in q], abs=1e-6)
    emb = gguf_file.raw_block("token_embd.weight", 7, 0)
    assert emb["type"] == "Q8_0" and len(emb["bytes"]) == 34 and emb["minimum"] == 0.0
    assert emb["q"] == list(np.frombuffer(emb["bytes"][2:], dtype=np.int8))


def test_an_unknown_or_unblocked_tensor_is_named():
    with pytest.raises(KeyError, match="tensors"):
        gguf_file.raw_block("blk.99.nothing")
    with pytest.raises(ValueError, match="F32"):
        gguf_file.raw_block("blk.0.attn_norm.weight")


def test_the_row_order_is_llama_cpps():
    """llama.cpp's converter: reshape(heads, 2, D/2, K).swapaxes(1, 2); written here again in numpy."""
    w = torch.arange(2 * 8 * 3).reshape(16, 3).float()  # 2 heads of D=8
    want = w.numpy().reshape(2, 2, 4, 3).swapaxes(1, 2).reshape(16, 3)
    assert np.array_equal(gguf_file.to_file_rows(w, 2).numpy(), want)


class _Changed:
    """A transformers-like model whose one weight differs from the file's."""
    def __init__(self, model, key, tweak):
        self.config, self._state = model.config, dict(model.state_dict())
        self._state[key] = tweak(self._state[key].clone())

    def state_dict(self):
        return self._state


def test_every_file_tensor_is_the_course_weights_and_a_changed_one_is_caught(model):
    report = gguf_file.check_against_file(model)
    assert len(report) == 211  # 30 layers x 7 matrices in Q4_1, and the Q8_0 embedding
    assert all(r["same_blocks"] for r in report if r["type"] == "Q4_1")
    assert max(r["max_diff"] for r in report) == 0.0

    def tweak(w):
        w[5, 40] += 1.0  # beyond the block's range: its scale, and so the file's blocks, no longer come back
        return w
    changed = gguf_file.check_against_file(_Changed(model, "model.layers.4.self_attn.q_proj.weight", tweak))
    bad = [r["name"] for r in changed if r["max_diff"] > 0]
    assert bad == ["blk.4.attn_q.weight"]
    assert not next(r for r in changed if r["name"] == "blk.4.attn_q.weight")["same_blocks"]


def test_round_trip_at_the_files_rule_is_q4_1():
    w = torch.randn(8, 64)
    assert torch.allclose(quality.round_trip(w, 4, 32), formats.dequantize_int4(*formats.quantize_int4(w)), atol=1e-6)


@pytest.mark.parametrize("bits, group, symmetric", [(2, 32, False), (3, 64, False), (4, 32, True), (8, 16, True)])
def test_round_trip_levels_and_error(bits, group, symmetric):
    w = torch.randn(6, 128)
    r = quality.round_trip(w, bits, group, symmetric)
    blocks, rb = w.reshape(6, -1, group), r.reshape(6, -1, group)
    for b, got in zip(blocks.reshape(-1, group), rb.reshape(-1, group)):
        assert len(torch.unique(got)) <= 2 ** bits
        step = (b.abs().max() / (2 ** (bits - 1) - 1)) if symmetric else (b.max() - b.min()) / (2 ** bits - 1)
        assert (got - b).abs().max() <= step / 2 + 1e-5  # half a step at most
    if symmetric:
        assert quality.round_trip(torch.zeros(1, group), bits, group, True).eq(0).all()
    assert quality.bits_per_weight(bits, group, symmetric) == bits + (16 if symmetric else 32) / group


def test_round_trip_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="multiple of the group"):
        quality.round_trip(torch.randn(4, 576), 4, 128)
    with pytest.raises(ValueError, match="bits"):
        quality.round_trip(torch.randn(4, 64), 1, 32)


def test_requantized_changes_only_the_part_asked(ours, tokenizer):
    ids = tokenizer("It is a truth universally acknowledged", add_special_tokens=False)["input_ids"]
    file_rule = quality.SCHEMES["4-bit min/max, 32 (the file's Q4_1)"]
    same = quality.requantized(ours, file_rule, "layers")
    assert quality.perplexity(same, ids) == pytest.approx(quality.perplexity(ours, ids), rel=1e-4)
    two = quality.SCHEMES["2-bit min/max, 32"]
    head = quality.requantized(ours, two, "head")
    assert head.embedding is ours.embedding and head.layers is ours.layers and head.lm_head is not ours.lm_head
    one = quality.requantized(ours, two, 3)
    assert [a is b for a, b in zip(one.layers, ours.layers)] == [i != 3 for i in range(len(ours.layers))]
    assert not torch.equal(one.layers[3].down.weight, ours.layers[3].down.weight)
    assert quality.perplexity(quality.requantized(ours, two, "layers"), ids) > 2 * quality.perplexity(ours, ids)
    with pytest.raises(ValueError, match="unknown part"):
        quality.requantized(ours, two, "mlp")
    with pytest.raises(ValueError, match="unknown part"):
        quality.requantized(ours, two, 30)
