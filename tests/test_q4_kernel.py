"""The course's own 4-bit kernel (runner/q4_kernel.py): its layout, its exact integer algebra, its fallbacks."""
import pytest
import torch

from course_lib.runner import formats, q4_kernel

AVAILABLE, WHY = q4_kernel.available()
needs_kernel = pytest.mark.skipif(not AVAILABLE, reason=WHY or "available")


def unpack(w: torch.Tensor, K: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The layout read back, written independently of pack: (N/8, K/32, 160) -> q (N, K), scale, minimum (N, K/32)."""
    tiles, blocks, _ = w.shape
    nibbles = w[..., :128].reshape(tiles, blocks, 4, 8, 4)  # (tile, block, i, j, e)
    q = torch.cat([nibbles & 0xF, nibbles >> 4], dim=2)  # chunks 0-3 then 4-7: (tile, block, chunk, j, e)
    q = q.permute(0, 3, 1, 2, 4).reshape(tiles * 8, K)
    halves = lambda part: part.contiguous().view(torch.float16).float().transpose(1, 2).reshape(tiles * 8, blocks)  # noqa: E731
    return q, halves(w[..., 128:144]), halves(w[..., 144:160])


def integer_rows(R: int, K: int, generator) -> torch.Tensor:
    """Rows whose every block of 32 already holds integers with largest magnitude 127: the kernel's rounding keeps
    them exactly (scale 1), so its answer must be the exact algebra."""
    x = torch.randint(-127, 128, (R, K), generator=generator).float()
    x.view(R, K // 32, 32)[:, :, 0] = 127.0 * torch.where(torch.rand(R, K // 32, generator=generator) < 0.5, -1, 1)
    return x


def test_pack_lays_out_tiles_of_eight_outputs_that_read_back():
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (16, 96), generator=g)
    scale, low = torch.rand(16, 3, generator=g).half().float(), torch.randn(16, 3, generator=g).half().float()
    w = q4_kernel.pack(q, scale, low)
    assert w.shape == (2, 3, 160) and w.dtype == torch.uint8  # 5 bits per weight: the file's Q4_1 size
    back, s, m = unpack(w, 96)
    assert torch.equal(back, q) and torch.equal(s, scale) and torch.equal(m, low)


@needs_kernel
@pytest.mark.parametrize("R", [1, 2, 3, 4, 5, 6, 7, 8, 9, 17])  # tiles of 8 rows: every count within one, and past it
def test_the_4_bit_product_is_the_exact_algebra_on_rows_it_need_not_round(R):
    g = torch.Generator().manual_seed(R)
    N, K = 24, 96  # three tiles, three blocks (an odd count)
    q = torch.randint(0, 16, (N, K), generator=g)
    scale = (torch.rand(N, K // 32, generator=g) * 0.01 + 0.001).half().float()
    low = (torch.randn(N, K // 32, generator=g) * 0.05).half().float()
    x = integer_rows(R, K, g)
    want = x.double() @ formats.dequantize_int4(q, scale, low).double().T  # (R, N)
    got = q4_kernel.product(x, q4_kernel.pack(q, scale, low))
    assert got.shape == (R, N) and got.dtype == torch.float32
    assert float((got.double() - want).abs().max()) <= 1e-5 * float(want.abs().max())
    # rows that do need rounding: within what 8 bits per block of 32 can hold
    y = torch.randn(R, K, generator=g)
    exact = y.double() @ formats.dequantize_int4(q, scale, low).double().T
    assert float((q4_kernel.product(y, q4_kernel.pack(q, scale, low)).double() - exact).norm() / exact.norm()) < 0.02  # 3 blocks a row


def q4_0_blocks(N: int, K: int, generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_0 file's blocks as quantize_int4 gives them back: weights d (k - 8), counted from each block's lowest;
    d of either sign, as llama.cpp's quantizer writes them (negative where the block's largest weight is positive)."""
    k = torch.randint(0, 16, (N, K // 32, 32), generator=generator)
    k[:, :, 0] = torch.randint(0, 4, (N, K // 32), generator=generator)  # the lowest level somewhere in 0..3
    sign = torch.randint(0, 2, (N, K // 32, 1), generator=generator) * 2 - 1
    d = (sign * (torch.rand(N, K // 32, 1, generator=generator) * 0.01 + 0.001)).half().float()
    return formats.quantize_int4((d * (k - 8)).reshape(N, K))


@needs_kernel
def test_q4_0_blocks_pack_without_their_minimum_and_multiply_exactly():
    g = torch.Generator().manual_seed(3)
    q, scale, low = q4_0_blocks(24, 96, g)
    w = q4_kernel.pack(q, scale, low)
    assert w.shape == (3, 3, 144)  # 4.5 bits per weight: the minimum is -8 d, not stored
    x = integer_rows(5, 96, g)
    want = x.double() @ formats.dequantize_int4(q, scale, low).double().T
    assert float((q4_kernel.product(x, w).double() - want).abs().max()) <= 1e-5 * float(want.abs().max())
    low[0, 0] += 0.3 * scale[0, 0]  # one block off the grid: the whole matrix keeps its minimums
    assert q4_kernel.symmetric_grid(q, scale, low) is None and q4_kernel.pack(q, scale, low).shape[-1] == 160


@needs_kernel
@pytest.mark.skipif(q4_kernel.best_variant() != "vnni", reason="the VNNI build needs a CPU with AVX-512 VNNI")
def test_the_vnni_and_avx2_builds_give_the_same_numbers():
    g = torch.Generator().manual_seed(7)
    q, scale = torch.randint(0, 16, (24, 96), generator=g), (torch.rand(24, 3, generator=g) * 0.01).half().float()
    four = q4_kernel.pack(q, scale, (torch.randn(24, 3, generator=g) * 0.05).half().float())
    eight = q4_kernel.pack_q8(torch.randn(16, 96, generator=g) * 0.05)
    for R in (1, 5):  # the same integer sums, then the same float steps: equal to the bit
        x = torch.randn(R, 96, generator=g)
        for w in (four, eight):
            assert torch.equal(q4_kernel.extension("vnni").block_product(x, w),
                               q4_kernel.extension("avx2").block_product(x, w))
    with pytest.raises(ValueError, match="no kernel variant"):
        q4_kernel.extension("neon")


@needs_kernel
def test_the_8_bit_product_keeps_the_signs_of_its_weights():
    g = torch.Generator().manual_seed(1)
    N, K = 16, 64
    scale = (torch.rand(N, K // 32, 1, generator=g) * 0.01 + 0.001).half().float()
    q = torch.randint(-127, 128, (N, K // 32, 32), generator=g)
    q[:, :, 0] = -127  # the largest magnitude, negative: pack_q8 must give this very block back
    weight = (q * scale).reshape(N, K)
    x = integer_rows(5, K, g)
    got = q4_kernel.product(x, q4_kernel.pack_q8(weight))
    want = x.double() @ weight.double().T
    assert float((got.double() - want).abs().max()) <= 1e-5 * float(want.abs().max())
    layer = q4_kernel.Q8Linear(weight)
    assert layer(x.to(torch.bfloat16).reshape(1, 5, K)).shape == (1, 5, N) and layer.nbytes == N * K // 32 * 34


@needs_kernel
def test_the_int4_q8_layer_against_its_dequantized_weights_in_both_dtypes():
    w = torch.randn(192, 576) * 0.05
    layer = formats.make_linear(w, "int4-q8", torch.float32)
    assert layer.format == "int4-q8" and layer.q4 is not None and layer.nbytes == 192 * 576 * 5 // 8
    want = (x := torch.randn(2, 3, 576)) @ formats.dequantize_int4(*formats.quantize_int4(w)).T
    for dtype in (torch.float32, torch.bfloat16):
        got = layer(x.to(dtype))
        assert got.dtype == dtype and float((got.float() - want).norm() / want.norm()) < 0.01
    with pytest.raises(ValueError, match="vectors of 576"):
        layer(torch.randn(1, 575))
    with pytest.raises(ValueError, match="runs on the CPU"):
        q4_kernel.product(torch.randn(1, 576, device="meta"), layer.q4)  # any tensor not in the CPU's memory
    with pytest.raises(ValueError, match="CPU only"):
        q4_kernel.Q8Linear(torch.randn(16, 64, device="meta"))


@needs_kernel
def test_torch_compile_keeps_the_kernel_as_one_operator():
    q = torch.randint(0, 16, (16, 64))
    w = q4_kernel.pack(q, torch.full((16, 2), 0.01), torch.zeros(16, 2))
    x = torch.randn(3, 64)
    compiled = torch.compile(lambda v: q4_kernel.product(v, w) * 2, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x), q4_kernel.product(x, w) * 2)


def test_a_layer_the_kernel_cannot_take_falls_back_with_its_reason(monkeypatch, capsys):
    assert "tiles of 8 outputs" in q4_kernel.why_unusable(12, 64)
    assert "tiles of 8 outputs" in q4_kernel.why_unusable(16, 48)
    monkeypatch.setattr(q4_kernel, "available", lambda: (False, "no C++ compiler in this test"))
    w = torch.randn(32, 64) * 0.05
    layer = formats.make_linear(w, "int4-q8", torch.float32)
    assert layer.q4 is None and layer.why_not == "no C++ compiler in this test"
    assert "torch's 4-bit kernel instead: no C++ compiler" in capsys.readouterr().out
    x = torch.randn(2, 64)
    want = x @ formats.dequantize_int4(*formats.quantize_int4(w)).T
    assert float((layer(x) - want).norm() / want.norm()) < 1e-4  # torch's kernel, float32 activations
    head = formats.make_linear(w, "q8", torch.float32)
    assert head.format == formats.INT4_HEAD


def test_the_kernel_says_why_it_cannot_run_on_another_cpu(monkeypatch):
    monkeypatch.setattr(q4_kernel.platform, "machine", lambda: "arm64")
    assert "x86" in q4_kernel.why_not()
    monkeypatch.setattr(q4_kernel.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(q4_kernel, "cpu_flags", lambda: {"avx2", "fma"})
    assert "f16c" in q4_kernel.why_not()
    monkeypatch.setattr(q4_kernel, "cpu_flags", lambda: {"avx2", "fma", "f16c"})
    monkeypatch.setattr(q4_kernel.shutil, "which", lambda name: None)
    assert "g++" in q4_kernel.why_not()
