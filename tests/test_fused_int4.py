"""The int4 format's fused step (q4_kernel.cpp's block_product_bf16, fused_step with bfloat16 products): the 4-bit
blocks times activations rounded to bfloat16 give the dequantized weights' products; a whole step stays within
bfloat16's rounding of the eager int4 step and gives its tokens on the tiny model; the engine takes it for int4;
a CPU without AVX-512 BF16, or an int4 model with the int8 copy, is refused with the reason."""
import pytest
import torch

from course_lib.engine.generation import generate, run_schedule
from course_lib.engine.request import Job
from course_lib.runner import formats, q4_kernel
from course_lib.runner.compiled import CompiledRunner
from course_lib.runner.fused_step import FusedDecode, why_not_fused
from course_lib.runner.model import Model
from course_lib.runner.static_step import StaticStep

RUNS = q4_kernel.available()[0] and not q4_kernel.why_not_bf16()
needs_bf16 = pytest.mark.skipif(not RUNS, reason=q4_kernel.why_not_bf16() or q4_kernel.available()[1] or "runs")


@pytest.fixture(scope="module")
def small_int4(tiny):
    return formats.convert(Model.from_transformers(tiny), "int4")


def symmetric_blocks(N: int, K: int) -> torch.Tensor:
    """Weights d (k - 8) per block of 32, as a Q4_0 file holds them: d float16, k in 0..15 with a 0 in every block."""
    g = torch.Generator().manual_seed(3)
    k = torch.randint(0, 16, (N, K), generator=g)
    k[:, ::32] = 0
    d = (torch.rand(N, K // 32, generator=g) * 0.1 + 0.01).half().float()
    return (d.repeat_interleave(32, dim=1) * (k - 8)).float()


@needs_bf16
@pytest.mark.parametrize("layout", [160, 144])
def test_the_bfloat16_product_gives_the_blocks_numbers(layout):
    """Every row count of a tile (1-9, 17), both layouts (Q4_1's scale and minimum; Q4_0's scale only): the product
    equals float64's of the same bfloat16 activations and the blocks' weights, to float32's rounding."""
    N, K = 64, 96
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(2)) if layout == 160 else symmetric_blocks(N, K)
    q, scale, low = formats.quantize_int4(w)
    packed = q4_kernel.pack(q, scale, low)
    assert packed.shape == (N // 8, K // 32, layout)
    weights = formats.dequantize_int4(q, scale.half().float(), low.half().float()).double()  # the float16 blocks
    if layout == 144:
        weights = w.double()
    code = q4_kernel.extension()
    for rows in [*range(1, 10), 17]:
        x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows))
        got = code.block_product_bf16(x, packed)
        want = x.bfloat16().double() @ weights.T
        assert float((got.double() - want).abs().max()) <= 2e-5 * float(want.abs().max()), rows


@needs_bf16
def test_the_bfloat16_product_refuses_other_inputs_with_a_message():
    q, scale, low = formats.quantize_int4(torch.randn(16, 64))
    code = q4_kernel.extension()
    with pytest.raises(RuntimeError, match="float32"):
        code.block_product_bf16(torch.randn(2, 64).bfloat16(), q4_kernel.pack(q, scale, low))
    with pytest.raises(RuntimeError, match="4-bit tiles"):
        code.block_product_bf16(torch.randn(2, 64), q4_kernel.pack_q8(torch.randn(16, 64)))


@needs_bf16
@pytest.mark.skipif(not formats.int8_dynamic_available(), reason="oneDNN's int8 x int8 product is missing here")
def test_the_head_on_the_course_kernel_rounds_as_onednns_layer():
    """formats.Int8DynamicLinear (the int4 format's head): each row rounded to 256 levels between its minimum and
    maximum, int8 weights with one scale per output. The course's dynamic_int8_product rounds the same way and adds
    exact integer sums: its outputs equal oneDNN's to float32's rounding, for rows with and without negatives."""
    g = torch.Generator().manual_seed(4)
    layer = formats.Int8DynamicLinear(torch.randn(64, 96, generator=g) * 0.05, torch.float32)
    code = q4_kernel.extension()
    for rows, shift in ((1, 0.0), (3, 0.0), (8, 2.0), (9, -3.0)):
        x = torch.randn(rows, 96, generator=g) + shift  # shifted rows: all positive (or negative) for some
        want = layer(x)
        got = code.dynamic_int8_product(x, layer.tiles, layer.scale, layer.row_sums)
        assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max()), rows


@needs_bf16
def test_whole_steps_are_nearer_float32_activations_than_the_eager_int4_step(small_int4, tiny, tokenizer):
    """The eager int4 model rounds every activation to bfloat16, the fused step only each product's input: against
    the same 4-bit weights with float32 activations (int4-float32, the same 8-bit head), the fused step's logits are
    on average at least as near as the eager step's, the greedy tokens are the same on the tiny model, and the
    bfloat16 cache's new column is the eager step's to bfloat16's rounding."""
    assert why_not_fused(small_int4) == ""
    reference = formats.convert(Model.from_transformers(tiny), "int4-float32", head=formats.FORMATS["int4"][2])
    steps = {"eager": StaticStep(small_int4, 64), "fused": StaticStep(small_int4, 64, fused=True),
             "float32": StaticStep(reference, 64)}
    prompt = tokenizer.encode("Four bits, bfloat16 activations")
    logits = {name: step.prefill(prompt) for name, step in steps.items()}
    assert steps["fused"].cache.keys[0].dtype == torch.bfloat16
    error = {"eager": [], "fused": []}
    for _ in range(10):
        token = int(logits["float32"].argmax())
        assert int(logits["fused"].argmax()) == int(logits["eager"].argmax()) == token
        logits = {name: step(token) for name, step in steps.items()}
        assert torch.isfinite(logits["fused"]).all()
        want = logits["float32"].float()
        for name in error:
            error[name].append(float((logits[name].float() - want).abs().max() / want.abs().max()))
    assert max(error["fused"]) < 0.1 and sum(error["fused"]) <= sum(error["eager"]), error
    column = steps["fused"].position - 1
    for layer in (0, len(small_int4.layers) - 1):
        k_want = steps["eager"].cache.keys[layer][..., column, :].float()
        k_got = steps["fused"].cache.keys[layer][..., column, :].float()
        assert float((k_got - k_want).abs().max()) <= 0.03 * float(k_want.abs().max()) + 1e-6


@needs_bf16
def test_the_engine_runs_int4_batches_fused_with_each_rows_tokens(small_int4, tokenizer):
    """A left-padded batch of two gives each row's tokens of the same fused step run alone. (Against the eager int4
    model the second row parts at its 7th token on this tiny model: a near-tie that bfloat16 activations everywhere
    and bfloat16 only into the products break differently; its float32-activation tokens part at the 1st.)"""
    prompts = [tokenizer.encode(t) for t in ("Short", "A longer prompt, padded on the left of the other one")]
    runner = CompiledRunner(small_int4)
    assert runner.fused and runner.step_kind == "fused" and runner.warm() == 0.0
    want = [generate(runner, tokenizer, p, 8, stop_ids=()).token_ids for p in prompts]
    eager = [generate(small_int4, tokenizer, p, 8, stop_ids=()).token_ids for p in prompts]
    assert want[0] == eager[0] and want[1][:6] == eager[1][:6]
    jobs = [Job(f"r{i}", p, 8) for i, p in enumerate(prompts)]
    run_schedule(runner, jobs, max_batch=2, continuous=True)
    assert [j.tokens for j in jobs] == want
    assert runner.steps[(2, 256, torch.get_num_threads())].fused.bf16 and runner.static_calls > 0


def test_without_avx512_bf16_the_int4_format_says_why_and_keeps_torch_compile(tiny, monkeypatch):
    """A CPU without `dpbf16ps` (an AVX2 machine, or AVX-512 without BF16): no blocks kept, the reason given, and the
    engine's compiled runner falls back to torch.compile's step for int4 (fused 'auto' never insists)."""
    flags = q4_kernel.cpu_flags() - {"avx512_bf16"}
    monkeypatch.setattr(q4_kernel, "cpu_flags", lambda: flags)
    ours = Model.from_transformers(tiny)
    int4 = formats.convert(ours, "int4")
    assert int4.layers[0].qkv.bf16_blocks is None
    reason = why_not_fused(int4)
    assert "int4-q8" in reason and (q4_kernel.why_not() or "BF16") in reason
    with pytest.raises(ValueError, match="int4"):
        FusedDecode(int4)
    assert not CompiledRunner(int4, compile=False).fused


@pytest.mark.skipif(not formats.int_mm_available(), reason="torch's int8 x int8 product is missing here")
def test_an_int4_model_with_the_int8_copy_is_not_fused(tiny):
    int4 = formats.convert(Model.from_transformers(tiny), "int4", rows_int8=formats.ROWS_INT8)
    assert "int8 copy" in why_not_fused(int4) or not RUNS
