"""The static-shape decode step: the same logits as the engine's own decode step (eager, and compiled where a C++
compiler is at hand), the cache written at the position given as a tensor, and clear errors at its edges."""
import pytest
import torch

from course_lib.runner.forward import run_model
from course_lib.runner.model import Model
from course_lib.runner.static_step import StaticDecode, StaticStep, compile_available, span_of


@pytest.fixture(scope="module")
def small(tiny):
    return Model.from_transformers(tiny)


def reference(model, prompt: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and each step's logits from the model's ordinary call with its growing cache."""
    cache = model.new_cache(1, len(prompt) + n)
    logits, cache = run_model(model, torch.tensor([prompt]), cache)
    tokens, steps = [], []
    for _ in range(n):
        tokens.append(int(logits[0, -1].argmax()))
        logits, cache = run_model(model, torch.tensor([[tokens[-1]]]), cache)
        steps.append(logits[0, -1])
    return tokens, steps


def static_run(step: StaticStep, prompt: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    logits, tokens, steps = step.prefill(prompt), [], []
    for _ in range(n):
        tokens.append(int(logits.argmax()))
        logits = step(tokens[-1])
        steps.append(logits)
    return tokens, steps


def test_static_step_equals_the_models_decode_step(small, tokenizer):
    prompt = tokenizer.encode("The static step reads the whole cache")
    want_tokens, want = reference(small, prompt, 12)
    step = StaticStep(small, capacity=64)
    tokens, got = static_run(step, prompt, 12)
    assert tokens == want_tokens
    assert max(float((a - b).abs().max()) for a, b in zip(got, want)) < 1e-4
    assert step.cache.length == len(prompt) + 12 == step.position
    # the column past the last written one is still empty: the step wrote where the position said
    assert float(step.cache.keys[0][:, :, step.position:].abs().max()) == 0.0
    # a second prompt reuses the cache from the start: the old columns are hidden by the mask, not cleared
    tokens_again, _ = static_run(step, prompt, 12)
    assert tokens_again == want_tokens


def test_a_step_reads_only_its_span_of_a_large_cache(small, tokenizer):
    """A cache sized for a long conversation: the step reads the written columns rounded up (span_of), not the
    capacity. Columns past the span are filled with NaN: a step that read them would give NaN logits (a masked
    column's weight is zero, and zero times NaN is NaN)."""
    assert [span_of(c, 2048) for c in (0, 255, 256, 600, 1500)] == [256, 256, 512, 1024, 2048]
    assert span_of(900, 1000) == 1000
    prompt = tokenizer.encode("A short chat in a long cache")
    want_tokens, want = reference(small, prompt, 8)
    step = StaticStep(small, capacity=1024)
    for layer in range(len(small.layers)):
        step.cache.keys[layer][:, :, 256:] = float("nan")
        step.cache.values[layer][:, :, 256:] = float("nan")
    tokens, got = static_run(step, prompt, 8)
    assert tokens == want_tokens
    assert max(float((a - b).abs().max()) for a, b in zip(got, want)) < 1e-4


def test_the_edges_get_clear_errors(small, tokenizer):
    step = StaticStep(small, capacity=8)
    with pytest.raises(ValueError, match="prefill"):
        step(5)
    with pytest.raises(ValueError, match="empty"):
        step.prefill([])
    with pytest.raises(ValueError, match="no room"):
        step.prefill(list(range(8)))
    step.prefill([1, 2, 3, 4, 5, 6, 7])
    step(8)
    with pytest.raises(ValueError, match="full"):
        step(9)
    with pytest.raises(ValueError, match="capacity"):
        StaticStep(small, capacity=small.config.max_position_embeddings + 1)


def eight_bit_run(model, prompt: list[int], n: int, step: StaticDecode | None):
    """Greedy tokens, each step's logits and the cache, on lesson 17's 8-bit cache: the prompt through the model,
    then each token through `step` (None: the model's own decode step, which dequantizes the cache)."""
    from course_lib.engine.long_context import QuantizedKVCache
    cache = QuantizedKVCache(model, 1, 64 if step is None else step.capacity, bits=8)
    logits, cache = run_model(model, torch.tensor([prompt]), cache)
    tokens, steps = [], []
    for _ in range(n):
        tokens.append(int(logits[0, -1].argmax()))
        if step is None:
            logits, cache = run_model(model, torch.tensor([[tokens[-1]]]), cache)
        else:
            logits = step([[tokens[-1]]], cache)
        steps.append(logits[0, -1])
    return tokens, steps, cache


def test_the_static_step_reads_an_8_bit_cache_as_the_eager_cache_does(small, tokenizer):
    """The static step stores each new key and value by the eager cache's rule (same integers, same scales) and
    attends over the integers with each column's scale applied: the logits agree with the eager cache's, which
    dequantizes first. A step that forgot a scale would be off by the scale (about 1/127) everywhere."""
    prompt = tokenizer.encode("Eight bits per number, one scale per token")
    want_tokens, want, eager = eight_bit_run(small, prompt, 10, None)
    tokens, got, static = eight_bit_run(small, prompt, 10, StaticDecode(small, 1, 64))
    assert tokens == want_tokens
    assert max(float((a - b).abs().max()) for a, b in zip(got, want)) < 1e-4
    end = len(prompt) + 10
    for layer in range(len(small.layers)):
        assert torch.equal(static.stored[layer][:, :, :, :end], eager.stored[layer][:, :, :, :end])
        assert torch.equal(static.scales[layer][:, :, :, :end], eager.scales[layer][:, :, :, :end])


def test_a_4_bit_cache_gets_a_clear_error(small):
    from course_lib.engine.long_context import QuantizedKVCache
    cache = QuantizedKVCache(small, 1, 16, bits=4)
    cache.length = 3
    with pytest.raises(ValueError, match="8-bit.*in 4 bits"):
        StaticDecode(small, 1, 16)([[5]], cache)


@pytest.mark.slow
def test_the_compiled_step_gives_the_same_tokens(small, tokenizer):
    ok, why = compile_available()
    if not ok:
        pytest.skip(why)
    prompt = tokenizer.encode("Compiled once, run many times")
    want_tokens, want = reference(small, prompt, 6)
    step = StaticStep(small, capacity=32, compile=True)
    tokens, got = static_run(step, prompt, 6)
    assert tokens == want_tokens
    assert max(float((a - b).abs().max()) for a, b in zip(got, want)) < 1e-3  # fused kernels add in another order
    assert step.compile_seconds > 0
    # the same compiled code on lesson 17's 8-bit cache (another specialization: the integers and their scales).
    # The compiler divides by 127 as a product with its reciprocal: a few of the stored integers land one step
    # from the eager cache's (10 of 1,664 on this prompt), so the logits are close, not within 1e-3
    want_tokens, want, _ = eight_bit_run(small, prompt, 6, None)
    tokens, got, _ = eight_bit_run(small, prompt, 6, step.decode)
    assert tokens == want_tokens
    assert max(float((a - b).norm() / b.norm()) for a, b in zip(got, want)) < 0.01


@pytest.mark.slow
def test_a_head_the_compiler_cannot_take_runs_after_the_compiled_step(small, tokenizer):
    from course_lib.runner import formats
    ok, why = compile_available()
    if not ok or not formats.int8_dynamic_available():
        pytest.skip(why or "oneDNN's int8 x int8 product is missing here or saturates (no VNNI)")
    fast = formats.convert(small, "int4", head="int8-dynamic")
    assert not fast.lm_head.compiles
    prompt = tokenizer.encode("The head runs apart")
    eager = StaticStep(fast, capacity=32)
    want_tokens, want = static_run(eager, prompt, 5)
    step = StaticStep(fast, capacity=32, compile=True)
    assert step.head_apart
    tokens, got = static_run(step, prompt, 5)
    assert got[0].shape == want[0].shape
    # bfloat16 activations, added in another order by the fused kernels: close, not equal
    assert max(float((a.float() - b.float()).norm() / b.float().norm()) for a, b in zip(got, want)) < 0.05
    assert tokens == want_tokens  # the tiny model's wide weights leave no near-ties


def test_first_difference_finds_where_two_runs_part():
    from course_lib.measure.compiled import first_difference
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2  # one run stopped early: they part where it ended


def test_without_a_cpp_compiler_compiling_says_so(small, monkeypatch):
    import course_lib.runner.static_step as static_step
    monkeypatch.setattr(static_step.shutil, "which", lambda name: None)
    ok, why = compile_available()
    assert not ok and "C++ compiler" in why
    with pytest.raises(RuntimeError, match="C\\+\\+ compiler"):
        StaticStep(small, capacity=16, compile=True)
    StaticStep(small, capacity=16)  # the eager step needs none
