"""Lesson 11: the model written out equals the library's, its cache behaves, and it runs under the one loop."""

import pytest
import torch

from course_lib.engine.generation import generate, generate_static, stream
from course_lib.text.context import filler_ids, story_ids
from course_lib.engine.stages import decode_step, prefill
from course_lib.runner.kv_cache import KVCache, cache_bytes, model_kv_bytes_per_token
from course_lib.runner.model import Model, load, parameter_count

from conftest import chat_ids

EXAMPLES = ["What is the capital of France?", "What is the capital gains tax in France?",
            "The bank is closed because they had no money left."]


@pytest.fixture(scope="module")
def ours(model):
    return Model.from_transformers(model)


def library_logits(model, ids):
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0].float()  # (T, V)


@pytest.mark.parametrize("question", EXAMPLES)
def test_logits_match_the_library_at_every_position(model, tokenizer, ours, question):
    ids = chat_ids(tokenizer, question)
    mine = ours(input_ids=torch.tensor([ids]), logits_to_keep=0).logits[0]  # (T, V)
    assert mine.shape == (len(ids), model.config.vocab_size)
    assert (mine - library_logits(model, ids)).abs().max() < 1e-4


def test_logits_match_on_a_long_prompt(model, tokenizer, ours):
    ids = filler_ids(tokenizer, 1200)
    mine = ours(input_ids=torch.tensor([ids]), logits_to_keep=0).logits[0]
    assert (mine - library_logits(model, ids)).abs().max() < 1e-4


@pytest.mark.parametrize("question", EXAMPLES)
def test_greedy_tokens_equal_model_generate(model, tokenizer, ours, question):
    ids = chat_ids(tokenizer, question)
    with torch.inference_mode():
        theirs = model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                                pad_token_id=tokenizer.pad_token_id)[0, len(ids):].tolist()
    assert generate(ours, tokenizer, ids, 32).token_ids == theirs


@pytest.mark.slow
def test_a_256_token_story_is_identical(model, tokenizer, ours):
    ids = story_ids(tokenizer)
    with torch.inference_mode():
        theirs = model.generate(torch.tensor([ids]), max_new_tokens=256, min_new_tokens=256, do_sample=False,
                                pad_token_id=tokenizer.pad_token_id)[0, len(ids):].tolist()
    assert generate(ours, tokenizer, ids, 256, stop_ids=()).token_ids == theirs


def test_bfloat16_keeps_the_top_token(model, tokenizer):
    half = Model.from_transformers(model, dtype=torch.bfloat16)
    for question in EXAMPLES:
        ids = chat_ids(tokenizer, question)
        full = library_logits(model, ids)[-1]
        mine = half(input_ids=torch.tensor([ids])).logits[0, -1].float()
        assert int(mine.argmax()) == int(full.argmax())
        assert (mine - full).abs().max() < 1.5  # measured: about 0.3-0.8 on these prompts


def test_loaded_from_the_weight_cache_equals_from_the_library(model, tokenizer, ours):
    direct = load(device="cpu")
    ids = chat_ids(tokenizer, EXAMPLES[0])
    a = direct(input_ids=torch.tensor([ids])).logits
    b = ours(input_ids=torch.tensor([ids])).logits
    assert torch.equal(a, b)
    assert parameter_count(direct) == 134_515_008


def test_prefill_and_decode_on_our_cache_match_a_full_forward(model, tokenizer, ours):
    ids = chat_ids(tokenizer, EXAMPLES[0])
    full = library_logits(model, ids + [504, 3575])  # (T + 2, V)
    logits, cache = prefill(ours, ids)
    assert isinstance(cache, KVCache) and cache.length == len(ids)
    assert (logits[0] - full[len(ids) - 1]).abs().max() < 1e-4
    logits, cache = decode_step(ours, [504], cache)
    assert (logits[0] - full[len(ids)]).abs().max() < 1e-4
    logits, cache = decode_step(ours, [3575], cache)
    assert (logits[0] - full[len(ids) + 1]).abs().max() < 1e-4 and cache.length == len(ids) + 2


def test_cache_memory_is_the_lesson_07_formula(model, ours):
    cache = ours.new_cache(2, 100)
    per_token = model_kv_bytes_per_token(model.config, torch.float32)
    assert cache.nbytes() == cache_bytes(cache) == cache.formula_bytes() == 2 * 100 * per_token


def test_rollback_is_one_assignment_and_recomputes_the_same(tokenizer, ours):
    ids = chat_ids(tokenizer, EXAMPLES[0])
    logits, cache = prefill(ours, ids)
    first, _ = decode_step(ours, [504], cache)
    decode_step(ours, [999], cache)  # a token we then take back
    cache.rollback(len(ids))
    again, _ = decode_step(ours, [504], cache)
    assert torch.equal(first, again) and cache.length == len(ids) + 1
    with pytest.raises(ValueError, match="roll back"):
        cache.rollback(cache.length + 1)


def test_cache_grows_when_full_and_keeps_what_it_held(tokenizer, ours):
    ids = chat_ids(tokenizer, EXAMPLES[0])
    small = ours.new_cache(1, len(ids))  # exactly the prompt: the first decode step must grow it
    logits, cache = prefill(ours, ids, small)
    logits, cache = decode_step(ours, [504], cache)
    big_logits, big = prefill(ours, ids, ours.new_cache(1, len(ids) + 10))
    big_logits, big = decode_step(ours, [504], big)
    assert cache.capacity == 2 * len(ids) and torch.equal(logits, big_logits)


def test_stream_and_stop_strings_work_on_our_model(tokenizer, ours):
    ids = chat_ids(tokenizer, EXAMPLES[0])
    s = stream(ours, tokenizer, ids, 30)
    text = "".join(s)
    assert text == "The capital of France is Paris." and s.result.stop_reason == "end_of_turn"
    stopped = generate(ours, tokenizer, ids, 30, stop_strings=["France"])
    assert stopped.stop_reason == "stop_string" and stopped.text == "The capital of "


def test_batching_on_our_model_equals_each_alone(tokenizer, tiny):
    small = Model.from_transformers(tiny)  # the mechanism holds for any weights: the tiny random model
    prompts = [chat_ids(tokenizer, q, system=None) for q in EXAMPLES + ["Hi"]]
    batched = generate_static(small, tokenizer, prompts, max_new_tokens=16)
    for p, b in zip(prompts, batched):
        assert b == generate(small, tokenizer, p, 16).token_ids


def test_a_matrix_is_the_same_matrix_by_rows_or_by_columns():
    from course_lib.runner.model import Linear
    from course_lib.runner.layout import arrange, layout_of
    w = torch.randn(96, 40)
    rows, columns = arrange(w, "rows"), arrange(w, "columns")
    assert torch.equal(rows, w) and torch.equal(columns, w)  # same (out, in) values
    assert layout_of(rows) == "rows" and layout_of(columns) == "columns"
    assert columns.T.is_contiguous() and not columns.is_contiguous()
    x = torch.randn(3, 40)
    assert torch.allclose(Linear(w, "columns")(x), x @ w.T, atol=1e-5)
    with pytest.raises(ValueError, match="unknown layout 'diagonal'"):
        arrange(w, "diagonal")


def test_the_layout_follows_the_measured_gain(monkeypatch):
    from course_lib.runner import layout as m
    monkeypatch.setattr(m, "_layout_seen", {})
    gains = iter([2.0, 1.05])
    monkeypatch.setattr(m, "layout_gain", lambda w: next(gains))
    assert m.fastest_layout(torch.zeros(70, 30)) == "columns"  # twice as fast by columns: switch
    assert m.fastest_layout(torch.zeros(70, 30)) == "columns"  # measured once per shape, then remembered
    assert m.fastest_layout(torch.zeros(30, 70)) == "rows"  # 5% is within noise: keep the usual layout
    assert m.fastest_layout(torch.zeros(4)) == "rows"  # not a matrix


def test_layout_gain_measures_both_layouts_of_a_real_shape():
    from course_lib.runner.layout import layout_gain
    gain = layout_gain(torch.randn(960, 576) * 0.02, megabytes=4)
    assert 0.2 < gain < 10  # a ratio of two timings of the same product, not a constant


@pytest.mark.parametrize("layout", ["rows", "columns"])
def test_each_layout_matches_the_library(model, tokenizer, layout):
    arranged = Model.from_transformers(model, layout=layout, kernel="mkl")
    assert {arranged.lm_head.layout, arranged.layers[0].qkv.layout, arranged.layers[0].down.layout} == {layout}
    assert arranged.embedding.data_ptr() == arranged.lm_head.weight.data_ptr()  # tied: one tensor, not two
    ids = chat_ids(tokenizer, EXAMPLES[1])
    diff = (arranged(input_ids=torch.tensor([ids])).logits[0] - library_logits(model, ids)).abs().max()
    assert diff < 1e-4
    if layout == "rows":
        assert diff == 0  # the library's layout and kernel: the very same numbers
    with torch.inference_mode():
        theirs = model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                                pad_token_id=tokenizer.pad_token_id)[0, len(ids):].tolist()
    assert generate(arranged, tokenizer, ids, 32).token_ids == theirs


def test_several_rows_go_to_the_measured_kernel(monkeypatch):
    from course_lib.runner import layout as m
    from course_lib.runner.model import Linear
    if not m.onednn_available():
        pytest.skip("this torch build has no oneDNN linear kernel")
    w = torch.randn(96, 40)
    x = torch.randn(2, 3, 40)  # (B, T, in): six rows
    fast, usual = Linear(w, "columns", kernel="onednn"), Linear(w, "columns", kernel="mkl")
    assert fast.kernel == "onednn" and usual.kernel == "mkl"
    assert fast(x).shape == (2, 3, 96) and torch.allclose(fast(x), usual(x), atol=1e-5)
    assert torch.equal(fast(x[:1, :1]), usual(x[:1, :1]))  # one row: always the usual kernel
    many = torch.randn(1, 40, 40)  # a prompt's worth of rows: the usual kernel too
    assert torch.equal(fast(many), usual(many))
    monkeypatch.setattr(m, "_kernel_seen", {})
    gains = iter([2.0, 1.0])
    monkeypatch.setattr(m, "several_rows_gain", lambda w: next(gains))
    assert m.several_rows_kernel(torch.zeros(70, 30)) == "onednn"
    assert m.several_rows_kernel(torch.zeros(30, 70)) == "mkl"
    assert m.several_rows_kernel(torch.zeros(30, 70, dtype=torch.bfloat16)) == "mkl"  # float32 only
    with pytest.raises(ValueError, match="unknown kernel 'blas'"):
        Linear(w, kernel="blas")
