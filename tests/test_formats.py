"""Lesson 12: every weight format is the same model within its tolerance, and 4-bit is the file's own blocks."""
from pathlib import Path

import pytest
import torch

from course_lib.runner import formats
from course_lib.text.context import chat_ids
from course_lib.measure.race import generate_exact
from course_lib.measure import quality
from course_lib.engine.generation import generate, generate_static
from course_lib.runner.model import Model

QUESTIONS = ["What is the capital of France?", "What is the capital gains tax in France?",
             "The bank is closed because they had no money left."]


@pytest.fixture(scope="module")
def ours(model):
    return Model.from_transformers(model)


@pytest.fixture(scope="module")
def converted(ours):
    return {name: formats.convert(ours, name) for name in formats.FORMATS}


def test_int8_quantization_round_trip():
    w = torch.randn(64, 96)
    q, scale = formats.quantize_int8(w)
    assert q.dtype == torch.int8 and q.abs().max() == 127
    assert (q.float() * scale[:, None] - w).abs().max() <= scale.max() / 2 + 1e-6  # half a step at most


def test_int4_keeps_the_grid_of_weights_that_are_already_4_bit():
    """A Q4_0 file's blocks are d * (k - 8) and seldom use both ends of -8..7: the min/max rule would round them
    again (its step is the span over 15); the quantizer keeps their own step, so they come back exactly."""
    g = torch.Generator().manual_seed(0)
    d = (torch.rand(64, 6, 1, generator=g) * 0.01 + 0.001).half().float()  # (N, K/32, 1): fp16 scales, as a file
    k = torch.randint(0, 16, (64, 6, 32), generator=g)
    k[::2] = k[::2].clamp(max=11)  # half the rows never reach the top of the range
    w = (d * (k - 8)).reshape(64, 192)
    assert torch.equal(formats.dequantize_int4(*formats.quantize_int4(w)), w)
    sparse = torch.tensor([-6.0, -3, 0, 8] * 8) * -0.1083984375  # a block of llama.cpp's file: gaps 3, 3, 8 steps
    assert torch.equal(formats.dequantize_int4(*formats.quantize_int4(sparse[None])), sparse[None])
    noise = torch.randn(64, 192, generator=g)  # weights on no grid: the min/max rule, half a step at most
    q, scale, low = formats.quantize_int4(noise)
    assert torch.equal(scale, (noise.reshape(64, 6, 32).amax(-1) - low) / 15)
    assert ((formats.dequantize_int4(q, scale, low) - noise).abs() <= scale.repeat_interleave(32, 1) / 2 + 1e-6).all()


@pytest.mark.parametrize("kind, dtype, tol", [("int8", torch.bfloat16, 0.01), ("int8-cast", torch.float32, 1e-5),
                                              ("int4", torch.bfloat16, 0.01), ("int4", torch.float32, 1e-5)])
def test_each_kernel_multiplies_like_its_dequantized_weights(kind, dtype, tol):
    w = torch.randn(192, 576) * 0.05
    layer = formats.make_linear(w, kind, dtype)
    if kind.startswith("int8"):
        q, scale = formats.quantize_int8(w)
        exact = q.float() * scale[:, None]
    else:
        exact = formats.dequantize_int4(*formats.quantize_int4(w))
    x = torch.randn(3, 576)
    got = layer(x.to(dtype)).float()  # (3, 192)
    want = x @ exact.T
    assert ((got - want).norm() / want.norm()) < tol


@pytest.mark.skipif(not formats.int8_dynamic_available(),
                    reason="oneDNN's int8 x int8 product is missing here or saturates (no VNNI)")
def test_the_int8_dynamic_head_is_the_exact_algebra_of_its_rounded_rows():
    torch.manual_seed(0)
    w = torch.randn(300, 64) * 0.05
    layer = formats.make_linear(w, "int8-dynamic", torch.float32)
    x = torch.randn(2, 3, 64) + 0.4  # rows that are not centred on zero: the zero point matters
    got = layer(x)
    # what the layer should compute: each row rounded to 256 levels between min(row, 0) and max(row, 0), times
    # the int8 weights, written out here in float64 without the kernel
    flat = x.reshape(6, 64).double()
    low, high = flat.amin(1, keepdim=True).clamp(max=0), flat.amax(1, keepdim=True).clamp(min=0)
    s = (high - low) / 255
    z = torch.round(-low / s)
    rows = ((torch.round(flat / s) + z).clamp(0, 255) - z) * s
    q, scale = formats.quantize_int8(w)
    want = rows @ (q.double() * scale.double()[:, None]).T
    assert got.shape == (2, 3, 300)
    assert float((got.reshape(6, 300).double() - want).abs().max()) < 1e-4
    # all rows in one call equal each row alone (the rows' own scales, applied after the kernel)
    one_by_one = torch.cat([layer(x[i:i + 1, j:j + 1]).reshape(1, 300) for i in range(2) for j in range(3)])
    assert torch.equal(one_by_one, got.reshape(6, 300))
    # and it is a rounding of the float product, not something else
    exact = x.reshape(6, 64) @ w.T
    assert float((got.reshape(6, 300) - exact).norm() / exact.norm()) < 0.02
    assert layer.nbytes == 300 * 64 + 300 * 8 and layer.in_features == 64
    with pytest.raises(ValueError, match="vectors of 64"):
        layer(torch.randn(2, 63))


def test_the_int8_x_int8_probe_says_no_where_the_kernel_fails(monkeypatch):
    def missing(*args, **kwargs):
        raise RuntimeError("no oneDNN int8 product in this build")
    monkeypatch.setattr(torch.ops.onednn, "qlinear_prepack", missing)
    assert formats.int8_dynamic_available() is False  # then formats.INT4_HEAD is the weight-only "int8"
    assert formats.FORMATS["int4"][2] == formats.INT4_HEAD


def test_int4_with_float32_activations_equals_the_float32_model(ours, converted, tokenizer):
    ids = chat_ids(tokenizer, QUESTIONS[0], system="You are a helpful assistant.")
    a = ours(input_ids=torch.tensor([ids])).logits
    b = converted["int4-float32"](input_ids=torch.tensor([ids])).logits
    assert (a - b).abs().max() < 1e-3  # the same 4-bit values; only float rounding differs


@pytest.mark.parametrize("name", ["float32", "bfloat16", "int8-cast", "int8", "int4-float32", "int4"])
def test_every_format_answers_the_question(converted, tokenizer, name):
    ids = chat_ids(tokenizer, QUESTIONS[0], system="You are a helpful assistant.")
    assert generate(converted[name], tokenizer, ids, 16).text == "The capital of France is Paris."


def test_quality_against_float32_is_measured(ours, converted, tokenizer):
    prompts = [chat_ids(tokenizer, q, system="You are a helpful assistant.") for q in QUESTIONS]
    sequences = [p + generate_exact(ours, tokenizer, p, 16) for p in prompts]
    starts = [len(p) - 1 for p in prompts]
    same = quality.agreement(ours, ours, sequences, starts)
    assert same["top1_agreement"] == 1.0 and abs(same["kl"]) < 1e-6
    kl = {}
    for name in ("bfloat16", "int8", "int4", "int4-float32"):
        q = quality.agreement(ours, converted[name], sequences, starts)
        assert q["top1_agreement"] >= 0.9 and q["kl"] < 0.1, (name, q)
        kl[name] = q["kl"]
    # the order the reference implies (float32 is the file's 4-bit model): int4 with float32 activations is the
    # file's model itself; bfloat16 rounds only the activations; int8 re-rounds every weight onto its own grid
    assert abs(kl["int4-float32"]) < 1e-5 and 0 < kl["bfloat16"] < kl["int8"]


def test_bytes_per_token_shrink_with_the_format(converted):
    b = {name: m.weight_bytes() for name, m in converted.items()}
    assert b["bfloat16"] == pytest.approx(b["float32"] / 2, rel=1e-3)
    assert b["int8"] < b["float32"] / 3.9 and b["int4"] < b["int8"] * 0.75
    assert b["int4-float32"] > b["int4"]  # its head stays float32: exact, and heavier


def test_formats_run_under_batching(converted, tokenizer):
    prompts = [chat_ids(tokenizer, q, system=None) for q in QUESTIONS]
    model = converted["int8"]
    assert generate_static(model, tokenizer, prompts, 8) == [generate(model, tokenizer, p, 8).token_ids for p in prompts]


def test_unknown_format_and_wrong_start_are_refused(ours, converted):
    with pytest.raises(ValueError, match="choose one of"):
        formats.convert(ours, "int3")
    with pytest.raises(ValueError, match="float32"):
        formats.convert(converted["bfloat16"], "int8")


def test_perplexity_is_finite_and_ordered(ours, converted, tokenizer):
    text = (Path(__file__).resolve().parents[1] / "data" / "texts" / "english_prose.txt").read_text()
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:256]
    p32, p4 = quality.perplexity(ours, ids), quality.perplexity(converted["int4"], ids)
    assert 1 < p32 < 100 and abs(p4 - p32) / p32 < 0.1


@pytest.mark.skipif(not formats.int_mm_available(), reason="torch._int_mm is missing or inexact here")
def test_the_int4_rows_copy_is_the_exact_algebra_of_int8_rows_and_only_from_its_row_count(ours):
    torch.manual_seed(0)
    w = torch.randn(96, 64) * 0.05
    plain, rows = formats.Int4Linear(w, torch.bfloat16), formats.Int4Linear(w, torch.bfloat16, rows_int8=4)
    x = torch.randn(6, 64).to(torch.bfloat16)
    # fewer rows than rows_int8: the 4-bit kernel, bit for bit
    assert torch.equal(rows(x[:3]), plain(x[:3]))
    # from rows_int8 rows: each row rounded to 256 levels between min(row, 0) and max(row, 0), times the int8 copy
    # of the 4-bit weights, written out here in float64 without the kernel
    x = x + 0.5  # rows not centred on zero: the zero point matters
    got = rows(x).double()
    flat = x.double()
    low, high = flat.amin(1, keepdim=True).clamp(max=0), flat.amax(1, keepdim=True).clamp(min=0)
    s = (high - low) / 255
    z = torch.round(-low / s)
    q, scale = formats.quantize_int8(formats.dequantize_int4(*formats.quantize_int4(w)))
    want = (((torch.round(flat / s) + z).clamp(0, 255) - z) * s) @ (q.double() * scale.double()[:, None]).T
    assert float((got - want).abs().max()) < 2e-2 * float(want.abs().max())  # bfloat16 output rounding
    assert float((got - want).norm() / want.norm()) < 4e-3
    # a rounding of the 4-bit product, not something else
    near = plain(x).double()
    assert float((got - near).norm() / near.norm()) < 0.03
    assert rows.int8_nbytes == 96 * 64 + 96 * 8 and plain.int8_nbytes == 0 and rows.nbytes == plain.nbytes
    with pytest.raises(ValueError, match="rows_int8 is for the 4-bit formats"):
        formats.convert(ours, "bfloat16", rows_int8=4)
