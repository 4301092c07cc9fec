"""Lesson 17's caches and measurements: bytes per token against the real cache objects, the sink window against the
full cache and against a fresh computation of the tokens it kept, the quantized cache's round trip, its decode path
against the dequantized reference, its perplexity bound (and a broken scale that fails it), the strategies on the real
text, the needle prompt, and the errors bad arguments get."""
import pytest
import torch
import torch.nn.functional as F

from course_lib.engine.long_context import (KV_FORMATS, QuantizedKVCache, WindowCache, cache_bytes_per_token,
                                            crossover_tokens, dequantize_rows, first_token_share, found,
                                            long_text_ids, needle_ids, quantize_rows, stream_loss, NEEDLE, QUESTION)
from course_lib.runner.model import Model, layer_qkv


@pytest.fixture(scope="module")
def ours(model):
    return Model.from_transformers(model)


@pytest.fixture(scope="module")
def small(tiny):
    return Model.from_transformers(tiny)


@pytest.fixture(scope="module")
def text(tokenizer):
    return long_text_ids(tokenizer)


def test_long_text_is_longer_than_three_windows(text, ours):
    assert len(text) > 3 * ours.config.max_position_embeddings


# ----- bytes -----

def test_bytes_per_token_match_the_real_caches(ours):
    float_cache = ours.new_cache(1, 100)
    assert float_cache.nbytes() / 100 == cache_bytes_per_token(ours, "float32") == 46080
    for bits in (8, 4):
        q = QuantizedKVCache(ours, 1, 100, bits)
        stored = sum(t.numel() * t.element_size() for t in q.keys + q.values + q.key_scales + q.value_scales)
        assert stored / 100 == cache_bytes_per_token(ours, f"int{bits}")
        assert q.nbytes() == stored + 2 * q.read_k.numel() * 4  # the read buffers are counted too
    assert crossover_tokens(ours.weight_bytes(), cache_bytes_per_token(ours, "float32")) > ours.config.max_position_embeddings


# ----- the sink window -----

def test_a_window_that_never_fills_equals_the_full_cache(small, tokenizer, text):
    ids = text[:200]
    full = stream_loss(small, ids, "full", 512, 32)
    for name in ("window", "sinks", "restart"):
        assert torch.allclose(stream_loss(small, ids, name, 512, 32).nll, full.nll, atol=1e-5)


def test_kept_keys_are_turned_back_to_their_new_slots(small, text):
    """Layer 0's keys depend only on the token and its position: after eviction, the cache's layer-0 keys must equal
    a fresh computation of the kept tokens at positions 0, 1, 2... (sinks first, then the most recent)."""
    ids = text[:90]
    cache = WindowCache(small, budget=40, sinks=4)
    for pos in range(0, 90, 10):
        cache.make_room(10)
        small(torch.tensor([ids[pos:pos + 10]]), cache=cache)
    kept = ids[:4] + ids[90 - (cache.length - 4):]
    assert cache.length == 40 and cache.evicted == 50
    _, k, _ = layer_qkv(small, kept, 0)
    assert torch.allclose(cache.keys[0][:, :, :cache.length], k, atol=1e-5)
    v = layer_qkv(small, kept, 0)[2]
    assert torch.allclose(cache.values[0][:, :, :cache.length], v, atol=1e-5)


def test_sinks_beat_the_plain_window_on_the_real_text(ours, text):
    budget = 128
    runs = {name: stream_loss(ours, text[:384], name, budget, 64) for name in ("full", "window", "sinks", "restart")}
    assert runs["sinks"].perplexity(budget) < runs["window"].perplexity(budget)
    assert runs["full"].perplexity(budget) < runs["window"].perplexity(budget)
    assert runs["restart"].recomputed > 0 and max(r.max_tokens for n, r in runs.items() if n != "full") <= budget


def test_first_token_share_is_a_share_and_leaves_the_model_as_it_was(model, text):
    before = model.config._attn_implementation
    share = first_token_share(model, text[:48], sinks=4, queries=8)
    assert share.shape == (model.config.num_hidden_layers,) and ((share >= 0) & (share <= 1 + 1e-6)).all()
    assert model.config._attn_implementation == before
    assert (first_token_share(model, text[:48], sinks=48, queries=8) > 0.999).all()  # every key: all of it


# ----- the quantized cache -----

@pytest.mark.parametrize("bits", [8, 4])
def test_quantize_round_trip_is_within_half_a_step(bits):
    x = torch.randn(2, 3, 17, 64) * torch.rand(2, 3, 17, 1) * 10
    q, scale = quantize_rows(x, bits)
    assert q.shape[-1] == (64 if bits == 8 else 32) and scale.dtype == torch.float16
    back = dequantize_rows(q, scale, bits, torch.float32)
    assert ((back - x).abs() <= scale.float() / 2 + 1e-3 * x.abs()).all()


def test_four_bit_packing_is_exact_on_integers():
    x = torch.randint(-7, 8, (5, 64)).float()
    x[:, 0] = 7  # every row's largest magnitude is 7: the scale is 1
    q, scale = quantize_rows(x, 4)
    assert torch.equal(dequantize_rows(q, scale, 4, torch.float32), x)


@pytest.mark.parametrize("bits", [8, 4])
def test_decode_through_tiles_equals_attention_over_the_dequantized_cache(small, text, bits):
    cache = QuantizedKVCache(small, 1, 300, bits, tile=64)
    small(torch.tensor([text[:200]]), cache=cache)
    checked = []
    attend = cache.attend

    def compare(layer, q, k, v):
        out = attend(layer, q, k, v)
        end = cache.length + 1
        keys = dequantize_rows(cache.keys[layer][:, :, :end], cache.key_scales[layer][:, :, :end], bits, torch.float32)
        values = dequantize_rows(cache.values[layer][:, :, :end], cache.value_scales[layer][:, :, :end], bits, torch.float32)
        ref = F.scaled_dot_product_attention(q, keys, values, enable_gqa=True)
        checked.append(float((out - ref).abs().max() / ref.abs().max()))  # relative: the tiny model's values are large
        return out
    cache.attend = compare
    for i in range(3):
        small(torch.tensor([[text[200 + i]]]), cache=cache)
    assert len(checked) == 3 * len(small.layers) and max(checked) < 1e-5


def test_int8_cache_keeps_perplexity_within_one_percent_and_a_broken_scale_does_not(ours, text):
    ids = text[:384]
    base = stream_loss(ours, ids, "full", 384, 128).perplexity()
    good = stream_loss(ours, ids, "full", 384, 128, cache=QuantizedKVCache(ours, 1, 384, 8)).perplexity()
    assert abs(good / base - 1) <= 0.01

    class Broken(QuantizedKVCache):
        def scale_of(self, x):  # a scale four times too small: every large number clips at 127 steps
            q, scale = quantize_rows(x, 8)
            scale = scale / 4
            return torch.round(x / scale.float()).clamp(-127, 127).to(torch.int8), scale
    broken = stream_loss(ours, ids, "full", 384, 128, cache=Broken(ours, 1, 384, 8)).perplexity()
    assert abs(broken / base - 1) > 0.01


# ----- the needle -----

def test_needle_prompt_holds_the_fact_at_its_depth(tokenizer, text):
    for depth in (0.0, 0.5, 1.0):
        ids = needle_ids(tokenizer, text, 300, depth, 4817)
        prompt = tokenizer.decode(ids)
        assert NEEDLE.format(4817) in prompt and QUESTION in prompt and abs(len(ids) - 300) < 30
        where = prompt.index(NEEDLE.format(4817)) / prompt.index(QUESTION)
        assert abs(where - depth) < 0.2
    assert found("It is 4,817.", 4817) and not found("It is 4818.", 4817)


# ----- bad input -----

def test_bad_arguments_get_clear_errors(small, tokenizer, text):
    with pytest.raises(ValueError, match="sinks"):
        WindowCache(small, budget=4, sinks=4)
    window = WindowCache(small, budget=16, sinks=4)
    with pytest.raises(ValueError, match="cannot fit"):
        window.make_room(13)
    with pytest.raises(ValueError, match="make_room"):
        window.reserve(17)
    with pytest.raises(ValueError, match="strategy"):
        stream_loss(small, text[:10], "forget", 8, 2)
    with pytest.raises(ValueError, match="chunk"):
        stream_loss(small, text[:10], "sinks", 8, 5)
    with pytest.raises(ValueError, match="at least 2"):
        stream_loss(small, text[:1], "full", 8, 2)
    with pytest.raises(ValueError, match="builds its own"):
        stream_loss(small, text[:10], "window", 8, 2, cache=QuantizedKVCache(small, 1, 10))
    with pytest.raises(ValueError, match="bits"):
        QuantizedKVCache(small, 1, 8, bits=3)
    with pytest.raises(ValueError, match="do not fit"):
        QuantizedKVCache(small, 1, 8).reserve(9)
    with pytest.raises(ValueError, match="cache format"):
        cache_bytes_per_token(small, "fp8")
    with pytest.raises(ValueError, match="depth"):
        needle_ids(tokenizer, text, 100, 1.5, 1)
    with pytest.raises(ValueError, match="fewer than"):
        long_text_ids(tokenizer, 10 ** 6)
    assert set(KV_FORMATS) == {"float32", "bfloat16", "int8", "int4"}
