"""The fused decode step (runner/fused_step.py, q4_kernel.cpp's decode_layers): one C++ call for every block of the
int4-q8 model. A block gives the eager block's numbers up to float rounding; whole steps give the eager step's
tokens on the tiny model; it reads no column past its own; the engine runs it for int4-q8 batches; every other
model or cache gets a clear refusal."""
import pytest
import torch

from course_lib.engine.generation import generate, run_schedule
from course_lib.engine.long_context import QuantizedKVCache
from course_lib.engine.request import Job
from course_lib.engine.stages import prefill
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
        got = fused.code.decode_layers(x[0], fused.parts[:6], b.cache.keys[:1], b.cache.values[:1], [], [], cos, sin,
                                       torch.ones(1, 64, dtype=torch.bool), column, model.heads, model.kv_heads,
                                       model.eps, False)
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


def random_q8(heads: int, kv_heads: int, head_dim: int, vocab: int):
    """A random 2-layer model in the int4-q8 format with the given heads (the C++ takes query heads in groups of
    at most 4 per key/value head, and a head's numbers 32 at a time)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=vocab, hidden_size=heads * head_dim, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                         max_position_embeddings=512, tie_word_embeddings=True)
    torch.manual_seed(1)
    return formats.convert(Model.from_transformers(LlamaForCausalLM(config).eval()), "int4-q8")


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(6, 2, 64), (10, 2, 32), (4, 4, 40)])
@pytest.mark.parametrize("bits", [None, 8])
def test_head_groups_and_sizes_give_the_static_steps_numbers(heads, kv_heads, head_dim, bits, tokenizer):
    """G = 3 with heads of 64 (the course's model), G = 5 (a group of 4 and one of 1), and heads of 40 numbers
    (a last register set of one): on a left-padded batch of 2 over 70 columns (more than one tile of columns)."""
    model = random_q8(heads, kv_heads, head_dim, len(tokenizer))
    ids = torch.randint(5, 1000, (2, 70), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 96, dtype=torch.bool)
    mask[1, :3] = False  # row 1's first three columns hold padding
    caches = []
    for _ in range(2):
        cache = model.new_cache(2, 96) if bits is None else QuantizedKVCache(model, 2, 96, bits=bits)
        prefill(model, ids, cache)
        caches.append(cache)
    positions = torch.tensor([70, 67])
    want = StaticDecode(model, 2, 96)([[11], [12]], caches[0], positions, mask)
    got = FusedDecode(model)([[11], [12]], caches[1], positions, mask)
    assert float((got - want).abs().max()) <= 1e-3 * float(want.abs().max())


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
    assert "int4-q8" in why_not_fused(formats.convert(ours, "bfloat16"))  # the int4 format: tests/test_fused_int4.py
    assert "course's own model" in why_not_fused(tiny)
    with pytest.raises(ValueError, match="int4-q8"):
        FusedDecode(ours)
    with pytest.raises(ValueError, match="int4-q8"):
        CompiledRunner(ours, fused=True)
    assert not CompiledRunner(ours, compile=False).fused
    with pytest.raises(ValueError, match="not both"):
        StaticDecode(ours, 1, 64, compile=True, fused=True)


@needs_kernel
def test_an_8_bit_cache_gives_the_static_steps_numbers_and_stores_its_integers(small_q8, tokenizer):
    """The fused step on QuantizedKVCache(bits=8) against the static step's eager reading of the same cache
    (_Int8Columns: the integers, each column's scale on its score and on its weight)."""
    prompt = tokenizer.encode("Eight bits a number in the cache")
    caches = []
    for _ in range(2):
        cache = QuantizedKVCache(small_q8, 1, 64, bits=8)
        prefill(small_q8, torch.tensor([prompt]), cache)
        caches.append(cache)
    eager, fused = StaticDecode(small_q8, 1, 64), FusedDecode(small_q8)
    token = 700
    for _ in range(4):
        column = caches[0].length
        want, got = eager([[token]], caches[0]), fused([[token]], caches[1])
        assert float((got - want).abs().max()) <= 1e-3 * float(want.abs().max())
        for layer in range(len(small_q8.layers)):  # the same integers and scales written at the column
            assert (caches[1].stored[layer][..., column, :] - caches[0].stored[layer][..., column, :]).abs().max() <= 1
            assert torch.allclose(caches[1].scales[layer][..., column, :].float(),
                                  caches[0].scales[layer][..., column, :].float(), rtol=1e-2)
        token = int(want.argmax())
    assert caches[1].length == caches[0].length == len(prompt) + 4


@needs_kernel
def test_a_fused_step_refuses_a_4_bit_cache_and_a_wrong_row_count(small_q8):
    step = FusedDecode(small_q8)
    cache4 = QuantizedKVCache(small_q8, 1, 64, bits=4)
    with pytest.raises(ValueError, match="in 4 bits"):
        step([[1]], cache4)
    cache = small_q8.new_cache(2, 64)
    cache.length = 1
    with pytest.raises(ValueError, match="one token per row"):
        step([[1]], cache)
