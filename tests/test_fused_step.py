"""The fused decode step (runner/fused_step.py, q4_kernel.cpp's decode_layers): one C++ call for every block of the
int4-q8 model. A block gives the eager block's numbers up to float rounding; whole steps give the eager step's
tokens on the tiny model; it reads no column past its own; the engine runs it for int4-q8 batches; every other
model or cache gets a clear refusal."""
import pytest
import torch

from course_lib.engine.generation import generate, run_schedule
from course_lib.engine.long_context import QuantizedKVCache
from course_lib.engine.request import Job
from course_lib.runner import formats, q4_kernel
from course_lib.runner.compiled import CompiledRunner
from course_lib.runner.fused_step import FusedDecode, why_not_fused
from course_lib.runner.model import Model, block, embed
from course_lib.runner.static_step import StaticDecode, StaticStep, _Columns

AVAILABLE, WHY = q4_kernel.available()
needs_kernel = pytest.mark.skipif(not AVAILABLE, reason=WHY or "available")


@pytest.fixture(scope="module")
def small_q8(tiny):
    return formats.convert(Model.from_transformers(tiny), "int4-q8")


@needs_kernel
def test_one_block_gives_the_eager_blocks_numbers(small_q8, tokenizer):
    model = small_q8
    a, b = StaticStep(model, 64), StaticStep(model, 64)
    prompt = tokenizer.encode("a block written out in C++")
    a.prefill(prompt)
    b.prefill(prompt)
    column = len(prompt)
    fused = FusedDecode(model)
    with torch.inference_mode():
        x = embed(model, torch.tensor([[500]]))  # (1, 1, hidden)
        cos, sin = model.cos[column:column + 1], model.sin[column:column + 1]  # (1, D)
        got = fused.code.decode_layers(x[0], fused.parts[:6], b.cache.keys[:1], b.cache.values[:1], cos, sin,
                                       torch.ones(1, 64, dtype=torch.bool), column, model.heads, model.kv_heads,
                                       model.eps)
        seen = (torch.arange(64) <= column)[None, None, None]
        want = block(model, 0, x, cos[:, None, None], sin[:, None, None],
                     _Columns(a.cache.keys, a.cache.values, 64, torch.tensor([column]), seen), column, seen)
    assert float((got - want[0]).abs().max()) <= 1e-4 * float(want.abs().max())
    # this token's key and value went to the cache's column, as the eager step writes them
    assert torch.allclose(b.cache.keys[0][:, :, column], a.cache.keys[0][:, :, column], atol=1e-5)
    assert torch.allclose(b.cache.values[0][:, :, column], a.cache.values[0][:, :, column], atol=1e-5)


@needs_kernel
def test_whole_steps_give_the_eager_steps_tokens_and_read_no_later_column(small_q8, tokenizer):
    prompt = tokenizer.encode("Fused steps, one call each")
    eager, fused = StaticStep(small_q8, 128), StaticStep(small_q8, 128, fused=True)
    want, got = eager.prefill(prompt), fused.prefill(prompt)
    for layer in range(len(small_q8.layers)):  # columns not written yet hold garbage: a step must not read them
        fused.cache.keys[layer][:, :, len(prompt) + 1:] = float("nan")
        fused.cache.values[layer][:, :, len(prompt) + 1:] = float("nan")
    tokens_want, tokens_got = [], []
    for _ in range(8):
        tokens_want.append(int(want.argmax()))
        tokens_got.append(int(got.argmax()))
        assert torch.isfinite(got).all()
        assert float((got - want).abs().max()) <= 1e-3 * float(want.abs().max())
        want, got = eager(tokens_want[-1]), fused(tokens_got[-1])
        for layer in range(len(small_q8.layers)):
            fused.cache.keys[layer][:, :, fused.position + 1:] = float("nan")
    assert tokens_got == tokens_want


@needs_kernel
def test_the_engine_runs_int4_q8_batches_fused_with_each_rows_tokens(small_q8, tokenizer):
    prompts = [tokenizer.encode(t) for t in ("A short one", "A rather longer prompt, padded on the left of the other")]
    want = [generate(small_q8, tokenizer, p, 8, stop_ids=()).token_ids for p in prompts]
    runner = CompiledRunner(small_q8)
    assert runner.fused and runner.warm() == 0.0  # nothing to compile
    jobs = [Job(f"r{i}", p, 8) for i, p in enumerate(prompts)]
    run_schedule(runner, jobs, max_batch=2, continuous=True)
    assert [j.tokens for j in jobs] == want
    step = runner.steps[(2, 256, torch.get_num_threads())]
    assert step.fused is not None and runner.static_calls > 0


def test_other_formats_and_caches_are_refused_with_the_reason(tiny):
    ours = Model.from_transformers(tiny)
    assert "int4-q8" in why_not_fused(formats.convert(ours, "int4"))
    assert "int4-q8" in why_not_fused(formats.convert(ours, "bfloat16"))
    assert "course's own model" in why_not_fused(tiny)
    with pytest.raises(ValueError, match="int4-q8"):
        FusedDecode(ours)
    with pytest.raises(ValueError, match="int4-q8"):
        CompiledRunner(ours, fused=True)
    assert not CompiledRunner(ours, compile=False).fused
    with pytest.raises(ValueError, match="not both"):
        StaticDecode(ours, 1, 64, compile=True, fused=True)


@needs_kernel
def test_a_fused_step_refuses_an_8_bit_cache_and_a_wrong_row_count(small_q8):
    step = FusedDecode(small_q8)
    cache8 = QuantizedKVCache(small_q8, 1, 64, bits=8)
    with pytest.raises(ValueError, match="float32 KVCache"):
        step([[1]], cache8)
    cache = small_q8.new_cache(2, 64)
    cache.length = 1
    with pytest.raises(ValueError, match="one token per row"):
        step([[1]], cache)
