"""The course's own 4-bit kernel (issue: the fast path is the engine): 4-bit weights times 8-bit activations with
the CPU's byte dot products, the scheme llama.cpp runs on a CPU, written out in C++ (SOURCE) and built on first use.

What it does: `pack(q, scale, minimum)` lays the file's Q4_1 blocks out in tiles of 8 outputs: each 32-bit lane of
a register holds 4 consecutive weights of one output, so a row's 4 activations, copied to all 8 lanes, multiply 8
outputs at once and each lane adds up one output's sum (no sums across lanes). `product(x, w)` rounds each block
of 32 activations to 8 bits (symmetric, its largest magnitude to 127: llama.cpp's Q8_0 activations), multiplies
them by the 4-bit numbers with AVX2's `maddubs` (32 byte products per instruction), then applies each block's scale
and minimum in float: sum_i (d q_i + m) (a q'_i) = d a sum q q' + m a sum q'. One tile's weights serve up to 4
rows of activations, so a decode step of several rows reads them once. `pack_q8` and `Q8Linear` do the same for
the file's Q8_0 embedding (the int4-q8 format's head). `available()` says whether it runs here (x86 with AVX2,
FMA and F16C, a C++ compiler) and why not. Built by torch.utils.cpp_extension.load_inline into the course's cache
folder (about 40 s, once per machine); inside torch.compile it is one operator (course::block_product).
Measured on the course's AMD CPU (AVX2, no AVX-512), one thread, 1536 x 576 weights hot in cache, 2026-12-06:
24 / 38 / 70 / 135 us at 1 / 2 / 4 / 8 rows against torch's 4-bit kernel 138 / 147 / 233 / 462.
What it does not do: run on a GPU or an ARM CPU (the reason is printed, and the layer keeps torch's kernel), use
AVX-512 or VNNI where the CPU has them, or give torch's numbers: the activations lose what 8 bits per block of 32
cannot hold (tests/test_q4_kernel.py bounds it; the bench's engine section measures perplexity).
"""
from __future__ import annotations

import functools
import platform
import shutil

import torch

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <vector>

// Weights in tiles of 8 outputs by blocks of 32 inputs. 4 bits: 128 bytes of nibbles (byte 32i + 4j + e holds
// output j's weight 4i + e low and 4i + 16 + e high), then 8 scales and 8 minimums as float16: 160 bytes.
// 8 bits: 256 signed bytes (byte 32c + 4j + e is output j's weight 4c + e), then 8 scales: 272 bytes.
// Each 32-bit lane of a register holds one output's 4 consecutive weights, so one row's 4 activations, copied to
// all 8 lanes, multiply 8 outputs at once and each lane's sum is one output's: no sums across lanes at the end.
constexpr int64_t BYTES4 = 160, BYTES8 = 272;

// one row: each block of 32 activations -> 32 int8 (largest magnitude 127), its scale, and scale * integers' sum
template <typename T>
static void quantize_row(const T* x, int64_t K, int8_t* q, float* scales, float* sums) {
  for (int64_t b = 0; b < K / 32; ++b) {
    const T* xb = x + 32 * b;
    float amax = 0.f;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(static_cast<float>(xb[i])));
    const float step = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
    int total = 0;
    for (int i = 0; i < 32; ++i) {
      const int v = static_cast<int>(std::nearbyint(static_cast<float>(xb[i]) * inv));
      q[32 * b + i] = static_cast<int8_t>(v);
      total += v;
    }
    scales[b] = step;
    sums[b] = step * total;
  }
}

// R rows (at most 4) times one tile of 8 outputs, over all K/32 blocks
template <int R, int BITS>
static inline void tile_rows(const uint8_t* w, int64_t blocks, const int8_t* q, const float* sc, const float* su,
                             int64_t K, __m256* acc) {
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* wb = w + b * (BITS == 4 ? BYTES4 : BYTES8);
    __m256i sums[R];
    for (int r = 0; r < R; ++r) sums[r] = _mm256_setzero_si256();
    if (BITS == 4) {
      for (int i = 0; i < 4; ++i) {
        const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * i));
        const __m256i lo = _mm256_and_si256(packed, low), hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
        for (int r = 0; r < R; ++r) {
          const int8_t* a = q + r * K + 32 * b + 4 * i;
          int32_t a_lo, a_hi;
          std::memcpy(&a_lo, a, 4);
          std::memcpy(&a_hi, a + 16, 4);
          // 16-bit lanes: pairs of products (at most 2 * 15 * 127), 8 such added (at most 30,480 < 32,767)
          sums[r] = _mm256_add_epi16(sums[r], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(a_lo)));
          sums[r] = _mm256_add_epi16(sums[r], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(a_hi)));
        }
      }
      for (int r = 0; r < R; ++r) sums[r] = _mm256_madd_epi16(sums[r], ones);
    } else {
      for (int c = 0; c < 8; ++c) {
        const __m256i wc = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * c));
        const __m256i size = _mm256_sign_epi8(wc, wc);  // maddubs wants its first operand unsigned: |w| and a * sign(w)
        for (int r = 0; r < R; ++r) {
          int32_t a4;
          std::memcpy(&a4, q + r * K + 32 * b + 4 * c, 4);
          const __m256i pairs = _mm256_maddubs_epi16(size, _mm256_sign_epi8(_mm256_set1_epi32(a4), wc));
          sums[r] = _mm256_add_epi32(sums[r], _mm256_madd_epi16(pairs, ones));  // pairs reach 2 * 127 * 127: to 32 bits now
        }
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + (BITS == 4 ? 128 : 256))));
    for (int r = 0; r < R; ++r)
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r]), _mm256_mul_ps(d, _mm256_set1_ps(sc[r * (K / 32) + b])), acc[r]);
    if (BITS == 4) {
      const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + 144)));
      for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(su[r * (K / 32) + b]), acc[r]);
    }
  }
}

template <typename T>
static inline void store8(T* out, __m256 v) {
  if constexpr (std::is_same<T, float>::value) {
    _mm256_storeu_ps(out, v);
  } else {
    alignas(32) float f[8];
    _mm256_store_ps(f, v);
    for (int i = 0; i < 8; ++i) out[i] = static_cast<T>(f[i]);
  }
}

template <typename T, int BITS>
static void run(const torch::Tensor& x, const torch::Tensor& w, torch::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), tiles = w.size(0), blocks = K / 32, N = out.size(1);
  std::vector<int8_t> q(M * K);
  std::vector<float> sc(M * blocks), su(M * blocks);
  const T* xs = x.data_ptr<T>();
  for (int64_t r = 0; r < M; ++r) quantize_row(xs + r * K, K, q.data() + r * K, sc.data() + r * blocks, su.data() + r * blocks);
  const uint8_t* ws = w.data_ptr<uint8_t>();
  T* o = out.data_ptr<T>();
  const int64_t tile_bytes = blocks * (BITS == 4 ? BYTES4 : BYTES8);
  at::parallel_for(0, tiles, 4, [&](int64_t begin, int64_t end) {
    __m256 acc[4];
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t r0 = 0; r0 < M; r0 += 4) {
        const int rows = static_cast<int>(std::min<int64_t>(4, M - r0));
        const int8_t* qr = q.data() + r0 * K;
        const float *scr = sc.data() + r0 * blocks, *sur = su.data() + r0 * blocks;
        const uint8_t* wt = ws + t * tile_bytes;
        switch (rows) {
          case 1: tile_rows<1, BITS>(wt, blocks, qr, scr, sur, K, acc); break;
          case 2: tile_rows<2, BITS>(wt, blocks, qr, scr, sur, K, acc); break;
          case 3: tile_rows<3, BITS>(wt, blocks, qr, scr, sur, K, acc); break;
          default: tile_rows<4, BITS>(wt, blocks, qr, scr, sur, K, acc); break;
        }
        for (int r = 0; r < rows; ++r) store8(o + (r0 + r) * N + 8 * t, acc[r]);
      }
    }
  });
}

torch::Tensor block_product(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % 32 == 0, "x must be (rows, K) contiguous, K a multiple of 32");
  TORCH_CHECK(w.dim() == 3 && w.scalar_type() == torch::kUInt8 && w.size(1) * 32 == x.size(1) &&
              (w.size(2) == BYTES4 || w.size(2) == BYTES8), "w must be (N/8, K/32, 160 or 272) uint8");
  auto out = torch::empty({x.size(0), w.size(0) * 8}, x.options());
  const bool four = w.size(2) == BYTES4;
  if (x.scalar_type() == torch::kFloat) four ? run<float, 4>(x, w, out) : run<float, 8>(x, w, out);
  else if (x.scalar_type() == torch::kBFloat16) four ? run<at::BFloat16, 4>(x, w, out) : run<at::BFloat16, 8>(x, w, out);
  else TORCH_CHECK(false, "x must be float32 or bfloat16");
  return out;
}
"""
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"]


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


@functools.cache
def extension():
    """The built kernel (a Python module with block_product), compiled once into the course's cache folder."""
    reason = why_not()
    if reason:
        raise RuntimeError(reason)
    from torch.utils.cpp_extension import load_inline

    from ..loading import cache_root
    folder = cache_root() / "kernels" / "q4"
    folder.mkdir(parents=True, exist_ok=True)
    if not any(folder.glob("*.so")):
        print("building the course's 4-bit kernel (C++, once per machine: about 40 s)...", flush=True)
    return load_inline("course_q4", cpp_sources=SOURCE, functions=["block_product"], extra_cflags=FLAGS,
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
    """The kernel's layout of Q4_1 blocks: q (N, K) in 0..15, scale and minimum (N, K/32) -> (N/8, K/32, 160)
    uint8: per tile of 8 outputs and block of 32 inputs, 128 bytes of nibbles (byte 32i + 4j + e: output j's
    weight 4i + e low, 4i + 16 + e high), then the 8 scales and the 8 minimums as float16 (the file's own size)."""
    N, K = q.shape
    grid = q.to(torch.uint8).reshape(N // 8, 8, K // 32, 8, 4).permute(0, 2, 3, 1, 4)  # (tile, block, chunk, j, e)
    nibbles = (grid[:, :, :4] | (grid[:, :, 4:] << 4)).reshape(N // 8, K // 32, 128)
    return torch.cat([nibbles, _per_tile(scale), _per_tile(minimum)], dim=-1).contiguous()


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
