"""The course's own 4-bit kernel (issue: the fast path is the engine): 4-bit weights times 8-bit activations with
the CPU's byte dot products, the scheme llama.cpp runs on a CPU, written out in C++ (q4_kernel.cpp) and built on first use.

What it does: `pack(q, scale, minimum)` lays the file's Q4_1 blocks out in tiles of 8 outputs: each 32-bit lane of a
register holds 4 consecutive weights of one output, so a row's 4 activations, copied to all 8 lanes, multiply 8
outputs at once and each lane adds up one output's sum (no sums across lanes). `product(x, w)` rounds each block of 32
activations to 8 bits (symmetric, its largest magnitude to 127: llama.cpp's Q8_0 activations), multiplies them by the
4-bit numbers with AVX2's `maddubs` (32 byte products per instruction), then applies each block's scale and minimum in
float: sum_i (d q_i + m) (a q'_i) = d a sum q q' + m a sum q'. One tile's weights serve up to 8 rows of activations,
so a decode step of several rows reads them once (with fewer than 8 rows each row's sum is split in two or four, so
that the byte products do not wait on each other). `pack_q8` and `Q8Linear` do the same for the file's Q8_0 embedding
(the int4-q8 format's head). For the int4 format's fused step the same tiles meet activations rounded to bfloat16
instead (`block_product_bf16`, AVX-512 BF16's `dpbf16ps`; `why_not_bf16` says where it runs), and `pack_int8` /
`dynamic_int8_product` compute its head (formats.Int8DynamicLinear) with `dpbusd`, unsigned activations times signed
weights, rounded as that layer rounds them. Two builds of one source: 'vnni' where the CPU has AVX-512 VNNI (`dpbusd`
adds 4 byte products into a 32-bit lane in one instruction), else 'avx2'. `available()` says whether it runs here (x86
with AVX2, FMA and F16C, a C++ compiler) and why not. Built by torch.utils.cpp_extension.load_inline into the course's
cache folder (about 40 s, once per machine); inside torch.compile one operator (course::block_product).
Measured on an AMD CPU with AVX2 only, one thread, 1536 x 576 weights hot in cache, 2026-12-06 (tiles of 4 rows then):
24 / 38 / 70 / 135 us at 1 / 2 / 4 / 8 rows against torch's 4-bit kernel 138 / 147 / 233 / 462. On the AVX-512 VNNI
machine, 2026-12-07, all 120 products of a decode step from memory, 8 rows: 9.4 ms with tiles of 4, 8.5 with 8.
What it does not do: run on a GPU or an ARM CPU (the reason is printed, and the layer keeps torch's kernel), use
512-bit registers (except the bfloat16 product's), or give torch's numbers: the activations lose what 8 bits per block
of 32 cannot hold (tests/test_q4_kernel.py bounds it; the bench's engine section measures perplexity).
"""
from __future__ import annotations

import functools
import platform
import shutil
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("q4_kernel.cpp")  # the C++, beside this file
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"]
VNNI_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-DCOURSE_VNNI"]
FUNCTIONS = ["block_product", "block_product_bf16", "dynamic_int8_product", "decode_layers",
             "step_tokens"]  # what the C++ exports


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux reports them (empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as info:
            return next((set(line.split(":", 1)[1].split()) for line in info if line.startswith("flags")), set())
    except OSError:
        return set()


def why_not() -> str:
    """'' when the kernel can be built and run here; else the reason, with what fixes it where something can."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the course's 4-bit kernel is written for x86 CPUs (AVX2); this is {platform.machine()}"
    missing = {"avx2", "fma", "f16c"} - cpu_flags()
    if missing:
        return f"the course's 4-bit kernel needs the CPU features {', '.join(sorted(missing))}, which this CPU lacks"
    if not any(shutil.which(cc) for cc in ("g++", "c++")):
        return "the course's 4-bit kernel is C++ built on first use and finds no C++ compiler (install g++)"
    return ""


def why_not_bf16() -> str:
    """'' when the bfloat16 product (block_product_bf16: the int4 format's fused step) can run here; else why not.
    It is built into the 'vnni' variant and needs AVX-512 BF16's `dpbf16ps` (two bfloat16 products a 32-bit lane)."""
    reason = why_not()
    if reason:
        return reason
    if best_variant() != "vnni" or "avx512_bf16" not in cpu_flags():
        return ("the int4 format's fused step needs AVX-512 with VNNI and BF16, which this CPU lacks "
                "(its compiled step is torch.compile's; the int4-q8 format's fused step runs on AVX2)")
    return ""


def best_variant() -> str:
    """'vnni' where the CPU adds byte products in one instruction (AVX-512 VNNI, with its 256-bit forms), else
    'avx2' (maddubs, then a second instruction to widen the sums)."""
    return "vnni" if {"avx512_vnni", "avx512vl", "avx512bw"} <= cpu_flags() else "avx2"


@functools.cache
def extension(variant: str | None = None):
    """The built kernel (a Python module with FUNCTIONS), compiled once per variant into the course's cache folder:
    `variant` 'avx2' or 'vnni' (best_variant() when None; the tests build both where the CPU runs both)."""
    reason = why_not()
    if reason:
        raise RuntimeError(reason)
    variant = variant or best_variant()
    if variant not in ("avx2", "vnni") or (variant == "vnni" and best_variant() != "vnni"):
        raise ValueError(f"no kernel variant {variant!r} on this CPU (it runs {best_variant()!r})")
    from torch.utils.cpp_extension import load_inline

    from ..loading import cache_root
    folder = cache_root() / "kernels" / f"q4-{variant}"
    folder.mkdir(parents=True, exist_ok=True)
    if not any(folder.glob("*.so")):
        print(f"building the course's 4-bit kernel ({variant}; C++, once per machine: about 40 s)...", flush=True)
    flags = FLAGS + (VNNI_FLAGS if variant == "vnni" else [])
    return load_inline(f"course_q4_{variant}", cpp_sources=SOURCE.read_text(), functions=FUNCTIONS, extra_cflags=flags,
                       extra_ldflags=["-fopenmp"], build_directory=str(folder), verbose=False)


@functools.cache
def available() -> tuple[bool, str]:
    """(True, '') when the kernel is built and runs here; else (False, why). Builds it on the first call."""
    reason = why_not()
    if reason:
        return False, reason
    try:
        extension()
    except (RuntimeError, OSError, ImportError) as error:  # a compiler that fails, a read-only cache
        return False, f"the course's 4-bit kernel did not build: {str(error).strip().splitlines()[-1]}"
    return True, ""


def pack(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """The kernel's layout of 4-bit blocks: q (N, K) in 0..15, scale and minimum (N, K/32) -> (N/8, K/32, 160)
    uint8: per tile of 8 outputs and block of 32 inputs, 128 bytes of nibbles (byte 32i + 4j + e: output j's
    weight 4i + e low, 4i + 16 + e high), then the 8 scales and the 8 minimums as float16 (the file's Q4_1 size).
    Where every block is a Q4_0 block (symmetric_grid), (N/8, K/32, 144): the nibbles of d (k - 8), the scales d."""
    N, K = q.shape
    grid = symmetric_grid(q, scale, minimum)
    if grid is not None:
        q, scale = grid
    levels = q.to(torch.uint8).reshape(N // 8, 8, K // 32, 8, 4).permute(0, 2, 3, 1, 4)  # (tile, block, chunk, j, e)
    nibbles = (levels[:, :, :4] | (levels[:, :, 4:] << 4)).reshape(N // 8, K // 32, 128)
    parts = [nibbles, _per_tile(scale)] + ([_per_tile(minimum)] if grid is None else [])
    return torch.cat(parts, dim=-1).contiguous()


def symmetric_grid(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Whether the blocks are a Q4_0 file's, weight = d (k - 8) with k in 0..15 and d of either sign (llama.cpp
    makes d negative where a block's largest weight is positive): per block (N, K/32), with m / scale a whole
    number of steps, either d = scale and k = q + 8 + m / scale, or d = -scale and k = 8 - m / scale - q
    (quantize_int4 counts q from the block's lowest level), whichever keeps k within 0..15. Returns (k (N, K),
    d (N, K/32)) when every block has one, else None. Such blocks' minimum costs no bytes (it is -8 d)."""
    N, K = q.shape
    d = scale.to(torch.float16).float()
    steps = minimum / d.clamp(min=1e-30)
    whole = steps.round()
    top = q.reshape(N, K // 32, 32).amax(dim=-1)
    exact = ((steps - whole).abs() < 1e-3) & (d > 0)
    up = exact & (whole + 8 >= 0) & (top + whole + 8 <= 15)  # d = scale
    down = exact & ~up & (8 - whole - top >= 0) & (8 - whole <= 15)  # d = -scale
    if not bool((up | down).all()):
        return None
    shift = (whole + 8).to(q.dtype).repeat_interleave(32, dim=1)
    flip = down.repeat_interleave(32, dim=1)
    k = torch.where(flip, 16 - shift - q, q + shift)  # 8 - whole - q = 16 - (whole + 8) - q
    return k, torch.where(down, -d, d)


def pack_q8(weight: torch.Tensor) -> torch.Tensor:
    """Q8_0 (the file's embedding format): each block of 32 weights as int8 with one scale, its largest magnitude
    at 127; weight (N, K) float -> (N/8, K/32, 272) uint8: 256 bytes (byte 32c + 4j + e: output j's weight 4c + e),
    then the 8 scales as float16. The course's float weights are the file's Q8_0 values: this gives its blocks back."""
    N, K = weight.shape
    blocks = weight.float().reshape(N, K // 32, 32)
    scale = blocks.abs().amax(dim=-1).clamp(min=1e-12) / 127  # (N, K/32)
    q = torch.round(blocks / scale[..., None]).clamp(-127, 127).to(torch.int8)
    grid = q.reshape(N // 8, 8, K // 32, 8, 4).permute(0, 2, 3, 1, 4).reshape(N // 8, K // 32, 256)
    return torch.cat([grid.view(torch.uint8), _per_tile(scale)], dim=-1).contiguous()


def pack_int8(q: torch.Tensor) -> torch.Tensor:
    """int8 weights (N, K) (formats.quantize_int8's, one scale per output kept apart) in the kernel's tiles:
    (N/8, K/32, 256) uint8, byte 32c + 4j + e of a block is output j's weight 4c + e (pack_q8's order, no scales)."""
    N, K = q.shape
    grid = q.reshape(N // 8, 8, K // 32, 8, 4).permute(0, 2, 3, 1, 4).reshape(N // 8, K // 32, 256)
    return grid.contiguous().view(torch.uint8)


def _per_tile(values: torch.Tensor) -> torch.Tensor:
    """(N, K/32) float -> (N/8, K/32, 16) uint8: each tile's 8 values for a block, as float16 bytes."""
    N, B = values.shape
    return values.reshape(N // 8, 8, B).transpose(1, 2).to(torch.float16).contiguous().view(torch.uint8)


def why_unusable(out_features: int, in_features: int, group: int = 32) -> str:
    """'' when a layer of that shape (and Q4_1 group) can use the kernel here; else why not."""
    if group != 32 or in_features % 32 or out_features % 8:
        return (f"the course's 4-bit kernel reads blocks of 32 inputs for tiles of 8 outputs: not a {out_features} x "
                f"{in_features} layer in groups of {group}")
    return available()[1]


@functools.cache
def say_once(message: str) -> None:
    """Print a fallback's reason once per process (every layer of a model would give the same one)."""
    print(message, flush=True)


@torch.library.custom_op("course::block_product", mutates_args=())
def block_product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The kernel as a torch operator, so that torch.compile keeps it as one call inside a compiled step."""
    return extension().block_product(x, w)


@block_product.register_fake
def _(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[0] * 8)


def product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x (R, K) float32 or bfloat16, contiguous, times the packed weights: (R, N) in x's dtype.
    note: called eagerly it goes straight to the built module (a torch operator's dispatch costs several
    microseconds, and a decode step makes about 120 of these calls); inside torch.compile, the operator."""
    if x.shape[-1] != w.shape[1] * 32:  # note: the C++ check would say so too, naming no shape
        raise ValueError(f"this layer takes vectors of {w.shape[1] * 32}, got shape {tuple(x.shape)}")
    if x.device.type != "cpu" or w.device.type != "cpu":  # note: the C++ reads the memory directly: a CPU kernel
        raise ValueError(f"the course's 4-bit kernel runs on the CPU, not on {x.device.type}")
    if torch.compiler.is_compiling():
        return block_product(x, w)
    return extension().block_product(x, w)


class Q8Linear:
    """A layer of Q8_0 weights (pack_q8) run by the course's kernel: the int4-q8 format's output head (the tied
    embedding, 8 bits in the file). Activations rounded to 8 bits per block of 32, as the 4-bit layers'."""
    format = "q8"

    def __init__(self, weight: torch.Tensor):
        if weight.device.type != "cpu":
            raise ValueError("the course's kernel runs on the CPU only; on a GPU use 'bfloat16' or 'int8-cast'")
        self.out_features, self.in_features = weight.shape
        self.w = pack_q8(weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        return product(flat, self.w).reshape(*x.shape[:-1], self.out_features)

    @property
    def nbytes(self) -> int:
        return self.w.numel()
