// The course's 4-bit kernel, read and built by q4_kernel.py (torch.utils.cpp_extension.load_inline).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

// Weights in tiles of 8 outputs by blocks of 32 inputs. 4 bits: 128 bytes of nibbles (byte 32i + 4j + e holds
// output j's weight 4i + e low and 4i + 16 + e high), then 8 scales and 8 minimums as float16: 160 bytes.
// 4 bits, symmetric (a Q4_0 file's blocks, weight d (q - 8)): the same 128 bytes, then 8 scales: 144 bytes.
// 8 bits: 256 signed bytes (byte 32c + 4j + e is output j's weight 4c + e), then 8 scales: 272 bytes.
// Each 32-bit lane of a register holds one output's 4 consecutive weights, so one row's 4 activations, copied to
// all 8 lanes, multiply 8 outputs at once and each lane's sum is one output's: no sums across lanes at the end.
constexpr int64_t BYTES4 = 160, BYTES40 = 144, BYTES8 = 272;
enum Kind { Q41 = 0, Q40 = 1, Q8 = 2 };  // the three layouts above
constexpr int64_t block_bytes(int kind) { return kind == Q41 ? BYTES4 : kind == Q40 ? BYTES40 : BYTES8; }

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

// R rows (at most 8) times one tile of 8 outputs, over all K/32 blocks. C sums per row, added at the block's end:
// a byte product waits on the one before it in its sum, so with few rows the sums are split to keep the unit busy
template <int R, int KIND>
static inline void tile_rows(const uint8_t* w, int64_t blocks, const int8_t* q, const float* sc, const float* su,
                             int64_t K, __m256* acc) {
  constexpr int C = R >= 8 ? 1 : R >= 4 ? 2 : 4;
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  (void)ones;  // the VNNI build adds its byte products without it
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* wb = w + b * block_bytes(KIND);
    __m256i sums[R][C];
    for (int r = 0; r < R; ++r) for (int c = 0; c < C; ++c) sums[r][c] = _mm256_setzero_si256();
    if (KIND != Q8) {
      for (int i = 0; i < 4; ++i) {
        const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * i));
        const __m256i lo = _mm256_and_si256(packed, low), hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
        for (int r = 0; r < R; ++r) {
          const int8_t* a = q + r * K + 32 * b + 4 * i;
          int32_t a_lo, a_hi;
          std::memcpy(&a_lo, a, 4);
          std::memcpy(&a_hi, a + 16, 4);
          __m256i& s0 = sums[r][(2 * i) % C];
          __m256i& s1 = sums[r][(2 * i + 1) % C];
#ifdef COURSE_VNNI
          s0 = _mm256_dpbusd_epi32(s0, lo, _mm256_set1_epi32(a_lo));
          s1 = _mm256_dpbusd_epi32(s1, hi, _mm256_set1_epi32(a_hi));
#else     // 16-bit lanes: pairs of products (at most 2 * 15 * 127), 8 such added (at most 30,480 < 32,767)
          s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(lo, _mm256_set1_epi32(a_lo)));
          s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(hi, _mm256_set1_epi32(a_hi)));
#endif
        }
      }
#ifndef COURSE_VNNI
      for (int r = 0; r < R; ++r) for (int c = 0; c < C; ++c) sums[r][c] = _mm256_madd_epi16(sums[r][c], ones);
#endif
    } else {
      for (int c8 = 0; c8 < 8; ++c8) {
        const __m256i wc = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * c8));
        const __m256i size = _mm256_sign_epi8(wc, wc);  // maddubs wants its first operand unsigned: |w| and a * sign(w)
        for (int r = 0; r < R; ++r) {
          int32_t a4;
          std::memcpy(&a4, q + r * K + 32 * b + 4 * c8, 4);
          __m256i& s = sums[r][c8 % C];
#ifdef COURSE_VNNI
          s = _mm256_dpbusd_epi32(s, size, _mm256_sign_epi8(_mm256_set1_epi32(a4), wc));
#else
          const __m256i pairs = _mm256_maddubs_epi16(size, _mm256_sign_epi8(_mm256_set1_epi32(a4), wc));
          s = _mm256_add_epi32(s, _mm256_madd_epi16(pairs, ones));  // pairs reach 2 * 127 * 127: to 32 bits now
#endif
        }
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + (KIND == Q8 ? 256 : 128))));
    for (int r = 0; r < R; ++r) {
      __m256i total = sums[r][0];
      for (int c = 1; c < C; ++c) total = _mm256_add_epi32(total, sums[r][c]);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(d, _mm256_set1_ps(sc[r * (K / 32) + b])), acc[r]);
    }
    if (KIND != Q8) {  // Q4_0's minimum is -8 d: no bytes for it
      const __m256 m = KIND == Q41 ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + 144)))
                                   : _mm256_mul_ps(d, _mm256_set1_ps(-8.f));
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

template <typename T, int KIND>
static void run(const torch::Tensor& x, const torch::Tensor& w, torch::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), tiles = w.size(0), blocks = K / 32, N = out.size(1);
  std::vector<int8_t> q(M * K);
  std::vector<float> sc(M * blocks), su(M * blocks);
  const T* xs = x.data_ptr<T>();
  for (int64_t r = 0; r < M; ++r) quantize_row(xs + r * K, K, q.data() + r * K, sc.data() + r * blocks, su.data() + r * blocks);
  const uint8_t* ws = w.data_ptr<uint8_t>();
  T* o = out.data_ptr<T>();
  const int64_t tile_bytes = blocks * block_bytes(KIND);
  at::parallel_for(0, tiles, 4, [&](int64_t begin, int64_t end) {
    __m256 acc[8];
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t r0 = 0; r0 < M; r0 += 8) {
        const int rows = static_cast<int>(std::min<int64_t>(8, M - r0));
        const int8_t* qr = q.data() + r0 * K;
        const float *scr = sc.data() + r0 * blocks, *sur = su.data() + r0 * blocks;
        const uint8_t* wt = ws + t * tile_bytes;
        switch (rows) {
          case 1: tile_rows<1, KIND>(wt, blocks, qr, scr, sur, K, acc); break;
          case 2: tile_rows<2, KIND>(wt, blocks, qr, scr, sur, K, acc); break;
          case 3: tile_rows<3, KIND>(wt, blocks, qr, scr, sur, K, acc); break;
          case 4: tile_rows<4, KIND>(wt, blocks, qr, scr, sur, K, acc); break;
          case 5: tile_rows<5, KIND>(wt, blocks, qr, scr, sur, K, acc); break;
          case 6: tile_rows<6, KIND>(wt, blocks, qr, scr, sur, K, acc); break;
          case 7: tile_rows<7, KIND>(wt, blocks, qr, scr, sur, K, acc); break;
          default: tile_rows<8, KIND>(wt, blocks, qr, scr, sur, K, acc); break;
        }
        for (int r = 0; r < rows; ++r) store8(o + (r0 + r) * N + 8 * t, acc[r]);
      }
    }
  });
}

torch::Tensor block_product(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % 32 == 0, "x must be (rows, K) contiguous, K a multiple of 32");
  TORCH_CHECK(w.dim() == 3 && w.scalar_type() == torch::kUInt8 && w.size(1) * 32 == x.size(1) &&
              (w.size(2) == BYTES4 || w.size(2) == BYTES40 || w.size(2) == BYTES8),
              "w must be (N/8, K/32, 160, 144 or 272) uint8");
  auto out = torch::empty({x.size(0), w.size(0) * 8}, x.options());
  const int kind = w.size(2) == BYTES4 ? Q41 : w.size(2) == BYTES40 ? Q40 : Q8;
  if (x.scalar_type() == torch::kFloat) {
    if (kind == Q41) run<float, Q41>(x, w, out); else if (kind == Q40) run<float, Q40>(x, w, out); else run<float, Q8>(x, w, out);
  } else if (x.scalar_type() == torch::kBFloat16) {
    if (kind == Q41) run<at::BFloat16, Q41>(x, w, out);
    else if (kind == Q40) run<at::BFloat16, Q40>(x, w, out);
    else run<at::BFloat16, Q8>(x, w, out);
  } else {
    TORCH_CHECK(false, "x must be float32 or bfloat16");
  }
  return out;
}

// ---- 4-bit weights times bfloat16 activations: the int4 format's products in the fused step (AVX-512 BF16) ----
// The same packed tiles. Each nibble n becomes the bfloat16 number 128 + n (its bits are 0x4300 | n: no table), two
// per 32-bit lane, so `dpbf16ps` adds two products a lane: lanes 2j and 2j + 1 of a 512-bit register are output
// j's (weights 4i + 2p, 4i + 2p + 1 in lane 2j + p), and a row's 4 activations, copied to every 64 bits, meet them.
// The offset comes out with the minimum: sum (d n + m) a = d sum (128 + n) a + (m - 128 d) sum a, a in bfloat16.
// Built into the 'vnni' variant only, behind a target attribute (its callers check the CPU has the instructions).
#ifdef COURSE_VNNI
#define COURSE_BF16 __attribute__((target("avx512bf16")))

// rows of float32 -> bfloat16 (round to nearest even, as torch rounds), and each block of 32's sum of those values
COURSE_BF16 static void round_rows_bf16(const float* x, int64_t M, int64_t K, uint16_t* a, float* sums) {
  for (int64_t r = 0; r < M; ++r)
    for (int64_t b = 0; b < K / 32; ++b) {
      const float* xb = x + r * K + 32 * b;
      const __m256bh h0 = _mm512_cvtneps_pbh(_mm512_loadu_ps(xb)), h1 = _mm512_cvtneps_pbh(_mm512_loadu_ps(xb + 16));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(a + r * K + 32 * b), reinterpret_cast<const __m256i&>(h0));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(a + r * K + 32 * b + 16), reinterpret_cast<const __m256i&>(h1));
      sums[r * (K / 32) + b] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_cvtpbh_ps(h0), _mm512_cvtpbh_ps(h1)));
    }
}

// R rows (at most 8) of bfloat16 activations times one tile of 8 outputs, over all K/32 blocks -> acc[r] (8 sums)
template <int R, int KIND>
COURSE_BF16 static inline void tile_rows_bf16(const uint8_t* w, int64_t blocks, const uint16_t* a, const float* su,
                                              int64_t K, __m256* acc) {
  constexpr int C = R >= 8 ? 1 : R >= 4 ? 2 : 4;  // independent sums per row, as tile_rows
  const __m512i low = _mm512_set1_epi16(0x000F), bias = _mm512_set1_epi16(0x4300);
  const __m512i twice = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  __m512 products[R];
  __m256 offsets[R];
  for (int r = 0; r < R; ++r) products[r] = _mm512_setzero_ps(), offsets[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* wb = w + b * block_bytes(KIND);
    __m512 sums[R][C];
    for (int r = 0; r < R; ++r) for (int c = 0; c < C; ++c) sums[r][c] = _mm512_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      const __m512i words = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * i)));
      const __m512i lo = _mm512_ternarylogic_epi32(words, low, bias, 0xEA);  // (words & low) | bias
      const __m512i hi = _mm512_ternarylogic_epi32(_mm512_srli_epi16(words, 4), low, bias, 0xEA);
      for (int r = 0; r < R; ++r) {
        const uint16_t* ar = a + r * K + 32 * b + 4 * i;
        long long a_lo, a_hi;
        std::memcpy(&a_lo, ar, 8);
        std::memcpy(&a_hi, ar + 16, 8);
        __m512& s0 = sums[r][(2 * i) % C];
        __m512& s1 = sums[r][(2 * i + 1) % C];
        s0 = _mm512_dpbf16_ps(s0, reinterpret_cast<const __m512bh&>(lo),
                              reinterpret_cast<const __m512bh&>(static_cast<const __m512i&>(_mm512_set1_epi64(a_lo))));
        s1 = _mm512_dpbf16_ps(s1, reinterpret_cast<const __m512bh&>(hi),
                              reinterpret_cast<const __m512bh&>(static_cast<const __m512i&>(_mm512_set1_epi64(a_hi))));
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + 128)));
    const __m512 d2 = _mm512_permutexvar_ps(twice, _mm512_castps256_ps512(d));
    const __m256 m = KIND == Q41 ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + 144)))
                                 : _mm256_mul_ps(d, _mm256_set1_ps(-8.f));
    const __m256 shifted = _mm256_fnmadd_ps(d, _mm256_set1_ps(128.f), m);  // m - 128 d
    for (int r = 0; r < R; ++r) {
      __m512 total = sums[r][0];
      for (int c = 1; c < C; ++c) total = _mm512_add_ps(total, sums[r][c]);
      products[r] = _mm512_fmadd_ps(total, d2, products[r]);
      offsets[r] = _mm256_fmadd_ps(shifted, _mm256_set1_ps(su[r * blocks + b]), offsets[r]);
    }
  }
  const __m512i pairs = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  for (int r = 0; r < R; ++r) {  // output j: lanes 2j and 2j + 1, then its offset
    const __m512 p = _mm512_permutexvar_ps(pairs, products[r]);
    const __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(p), 1));
    acc[r] = _mm256_add_ps(_mm256_add_ps(_mm512_castps512_ps256(p), high), offsets[r]);
  }
}

template <int KIND>
COURSE_BF16 static void tiles_bf16(const uint8_t* ws, int64_t begin, int64_t end, int64_t M, int64_t K,
                                   const uint16_t* a, const float* su, float* o, int64_t N) {
  const int64_t blocks = K / 32, tile_bytes = blocks * block_bytes(KIND);
  __m256 acc[8];
  for (int64_t t = begin; t < end; ++t)
    for (int64_t r0 = 0; r0 < M; r0 += 8) {
      const int rows = static_cast<int>(std::min<int64_t>(8, M - r0));
      const uint16_t* ar = a + r0 * K;
      const float* sr = su + r0 * blocks;
      const uint8_t* wt = ws + t * tile_bytes;
      switch (rows) {
        case 1: tile_rows_bf16<1, KIND>(wt, blocks, ar, sr, K, acc); break;
        case 2: tile_rows_bf16<2, KIND>(wt, blocks, ar, sr, K, acc); break;
        case 3: tile_rows_bf16<3, KIND>(wt, blocks, ar, sr, K, acc); break;
        case 4: tile_rows_bf16<4, KIND>(wt, blocks, ar, sr, K, acc); break;
        case 5: tile_rows_bf16<5, KIND>(wt, blocks, ar, sr, K, acc); break;
        case 6: tile_rows_bf16<6, KIND>(wt, blocks, ar, sr, K, acc); break;
        case 7: tile_rows_bf16<7, KIND>(wt, blocks, ar, sr, K, acc); break;
        default: tile_rows_bf16<8, KIND>(wt, blocks, ar, sr, K, acc); break;
      }
      for (int r = 0; r < rows; ++r) _mm256_storeu_ps(o + (r0 + r) * N + 8 * t, acc[r]);
    }
}
#endif

// x (rows, K) float32, rounded to bfloat16, times 4-bit tiles (160 or 144 bytes a block) -> (rows, N) float32
torch::Tensor block_product_bf16(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat && x.size(1) % 32 == 0,
              "x must be (rows, K) float32, contiguous, K a multiple of 32");
  TORCH_CHECK(w.dim() == 3 && w.scalar_type() == torch::kUInt8 && w.size(1) * 32 == x.size(1) &&
              (w.size(2) == BYTES4 || w.size(2) == BYTES40), "w must be (N/8, K/32, 160 or 144) uint8: 4-bit tiles");
#ifdef COURSE_VNNI
  TORCH_CHECK(__builtin_cpu_supports("avx512bf16"), "the bfloat16 product needs a CPU with AVX-512 BF16");
  const int64_t M = x.size(0), K = x.size(1), tiles = w.size(0), N = tiles * 8;
  std::vector<uint16_t> a(M * K);
  std::vector<float> su(M * (K / 32));
  round_rows_bf16(x.data_ptr<float>(), M, K, a.data(), su.data());
  auto out = torch::empty({M, N}, x.options());
  const uint8_t* ws = w.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  const bool q41 = w.size(2) == BYTES4;
  at::parallel_for(0, tiles, 4, [&](int64_t begin, int64_t end) {
    if (q41) tiles_bf16<Q41>(ws, begin, end, M, K, a.data(), su.data(), o, N);
    else tiles_bf16<Q40>(ws, begin, end, M, K, a.data(), su.data(), o, N);
  });
  return out;
#else
  TORCH_CHECK(false, "the bfloat16 product is built into the kernel's 'vnni' variant only (AVX-512)");
  return x;
#endif
}

// ---- the int4 format's output head (formats.Int8DynamicLinear) for the fused step ----
// x (R, K) float32, each row rounded as Int8DynamicLinear rounds it: 256 levels between min(x, 0) and max(x, 0)
// (s = (high - low) / 255, at least 1e-12; z = round(-low / s); q = round(x / s) + z within 0..255); w (N/8, K/32,
// 256) the int8 weights in tiles (pack_int8: byte 32c + 4j + e is output j's weight 4c + e of the block), w_scale
// and row_sums (N,) float32 as the layer keeps them; out = s (sum q w * w_scale - z row_sums): the same steps.
// `dpbusd` multiplies unsigned by signed bytes, just what these are; the integer sums are exact.
torch::Tensor dynamic_int8_product(torch::Tensor x, torch::Tensor w, torch::Tensor w_scale, torch::Tensor row_sums) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat && x.size(1) % 32 == 0,
              "x must be (rows, K) float32, contiguous, K a multiple of 32");
  TORCH_CHECK(w.dim() == 3 && w.scalar_type() == torch::kUInt8 && w.size(1) * 32 == x.size(1) && w.size(2) == 256,
              "w must be (N/8, K/32, 256) uint8: int8 weights in tiles");
  TORCH_CHECK(w_scale.scalar_type() == torch::kFloat && row_sums.scalar_type() == torch::kFloat &&
              w_scale.is_contiguous() && row_sums.is_contiguous() && w_scale.numel() == w.size(0) * 8 &&
              row_sums.numel() == w.size(0) * 8, "w_scale and row_sums must be (N,) float32");
#ifdef COURSE_VNNI
  const int64_t M = x.size(0), K = x.size(1), tiles = w.size(0), N = tiles * 8, blocks = K / 32;
  std::vector<uint8_t> q(M * K);
  std::vector<float> s(M), z(M);
  const float* xs = x.data_ptr<float>();
  for (int64_t r = 0; r < M; ++r) {
    const float* xr = xs + r * K;
    float low = 0.f, high = 0.f;
    for (int64_t k = 0; k < K; ++k) low = std::min(low, xr[k]), high = std::max(high, xr[k]);
    s[r] = std::max((high - low) / 255.f, 1e-12f);
    z[r] = std::nearbyint(-low / s[r]);
    for (int64_t k = 0; k < K; ++k)
      q[r * K + k] = static_cast<uint8_t>(std::min(255.f, std::max(0.f, std::nearbyint(xr[k] / s[r]) + z[r])));
  }
  auto out = torch::empty({M, N}, x.options());
  const uint8_t* ws = w.data_ptr<uint8_t>();
  const float *sc = w_scale.data_ptr<float>(), *rs = row_sums.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, tiles, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t r = 0; r < M; ++r) {
        __m256i sums[4];
        for (auto& sum : sums) sum = _mm256_setzero_si256();
        const uint8_t* qr = q.data() + r * K;
        for (int64_t b = 0; b < blocks; ++b) {
          const uint8_t* wb = ws + (t * blocks + b) * 256;
          for (int c = 0; c < 8; ++c) {
            int32_t a4;
            std::memcpy(&a4, qr + 32 * b + 4 * c, 4);
            sums[c % 4] = _mm256_dpbusd_epi32(sums[c % 4], _mm256_set1_epi32(a4),
                                              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * c)));
          }
        }
        const __m256i total = _mm256_add_epi32(_mm256_add_epi32(sums[0], sums[1]), _mm256_add_epi32(sums[2], sums[3]));
        const __m256 products = _mm256_mul_ps(_mm256_cvtepi32_ps(total), _mm256_loadu_ps(sc + 8 * t));
        const __m256 shifted = _mm256_sub_ps(products, _mm256_mul_ps(_mm256_set1_ps(z[r]), _mm256_loadu_ps(rs + 8 * t)));
        _mm256_storeu_ps(o + r * N + 8 * t, _mm256_mul_ps(_mm256_set1_ps(s[r]), shifted));
      }
  });
  return out;
#else
  TORCH_CHECK(false, "the int8 head is built into the kernel's 'vnni' variant only (AVX-512 VNNI)");
  return x;
#endif
}

// ---- the whole decode step in one call (fused_step.py): every layer of the model for B rows, one token each ----
// What a step does between its matrix products (norms, rotary, the cache write, attention, SwiGLU, residual adds)
// is a few thousand numbers a row; run from Python each costs more in calling than in arithmetic. Here it is plain
// loops in float32, and the products are the kernel above.

static void rms_norm(const float* x, const float* w, float eps, int64_t n, float* out) {
  double total = 0.0;
  for (int64_t i = 0; i < n; ++i) total += static_cast<double>(x[i]) * x[i];
  const float inv = 1.f / std::sqrt(static_cast<float>(total / n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * inv * w[i];
}

// e^x for 8 floats (Cephes' expf, as sse_mathfun writes it: x = n ln 2 + r, a degree-6 polynomial for e^r, 2^n
// in the exponent bits): within 2 ulp. Inputs below -87 give about 1e-38 instead of less, which no sum here notices.
static inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(two_n));
}

// 8 numbers of a cache column as floats: a float cache's as they are, a bfloat16 or 8-bit cache's converted
static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const at::BFloat16* p) {  // bfloat16: the top half of a float32's bits
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
static inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

static inline float hsum(__m256 v) {
  __m128 sum = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  sum = _mm_hadd_ps(sum, sum);
  return _mm_cvtss_f32(_mm_hadd_ps(sum, sum));
}

// q times one column of k (n numbers, a multiple of 8)
template <typename T>
static inline float dot(const float* q, const T* k, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load8(k + i), acc);
  return hsum(acc);
}

static void rotate(float* x, const float* cos, const float* sin, int64_t D) {  // pairs (i, i + D/2), as apply_rotary
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    x[i] = a * cos[i] - b * sin[i];
    x[i + half] = b * cos[i + half] + a * sin[i + half];
  }
}

// this step's key or value (D floats) into its cache column: copied (float cache), or rounded to 8 bits with one
// float16 scale, as runner/kv_cache.py's quantize_rows does it (scale = largest magnitude / 127, at least 1e-8,
// rounded to float16; each number divided by it, rounded half to even, within -127..127)
static inline void store_column(float* column, at::Half*, const float* x, int64_t D) {
  std::memcpy(column, x, D * sizeof(float));
}
static inline void store_column(at::BFloat16* column, at::Half*, const float* x, int64_t D) {
  for (int64_t d = 0; d < D; ++d) column[d] = static_cast<at::BFloat16>(x[d]);  // round to nearest even, as torch
}
static inline void store_column(int8_t* column, at::Half* scale, const float* x, int64_t D) {
  float top = 0.f;
  for (int64_t d = 0; d < D; ++d) top = std::max(top, std::fabs(x[d]));
  const at::Half half_scale = static_cast<at::Half>(std::max(top / 127.f, 1e-8f));
  const float step = static_cast<float>(half_scale);
  for (int64_t d = 0; d < D; ++d)
    column[d] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(x[d] / step))));
  *scale = half_scale;
}

// each of the G rows of scores w (span each) -> attention weights: an 8-bit key's scale multiplies its score and a
// value's scale its weight (as the static step's _Int8Columns); a hidden column (ok false) weighs exactly 0. Eight
// columns at a time: the largest score, the exponentials and their sum in 8 lanes (the lanes added in a fixed order
// at the end), the last span % 8 columns one by one.
static inline __m256 visible8(const bool* ok) {  // all ones in the lanes whose column is visible
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(ok));
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_cvtepu8_epi32(bytes), _mm256_setzero_si256()));
}

static inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}

static void softmax_rows(float* w, const at::Half* ks, const at::Half* vs, const bool* ok, int64_t span, int64_t G,
                         float scale) {
  const int64_t whole = span - span % 8;
  const __m256 hidden = _mm256_set1_ps(-INFINITY);
  for (int64_t j = 0; j < G; ++j) {
    float* wj = w + j * span;
    __m256 top8 = hidden;
    for (int64_t s = 0; s < whole; s += 8) {
      __m256 x = _mm256_mul_ps(_mm256_loadu_ps(wj + s), _mm256_set1_ps(scale));
      if (ks) x = _mm256_mul_ps(x, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ks + s))));
      x = _mm256_blendv_ps(hidden, x, visible8(ok + s));
      _mm256_storeu_ps(wj + s, x);
      top8 = _mm256_max_ps(top8, x);
    }
    float top = hmax(top8);
    for (int64_t s = whole; s < span; ++s) {
      wj[s] = ok[s] ? wj[s] * scale * (ks ? static_cast<float>(ks[s]) : 1.f) : -INFINITY;
      top = std::max(top, wj[s]);
    }
    __m256 sum8 = _mm256_setzero_ps();
    for (int64_t s = 0; s < whole; s += 8) {
      const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_loadu_ps(wj + s), _mm256_set1_ps(top))),
                                     visible8(ok + s));  // a hidden column weighs nothing, exactly
      _mm256_storeu_ps(wj + s, e);
      sum8 = _mm256_add_ps(sum8, e);
    }
    float total = hsum(sum8);
    for (int64_t s = whole; s < span; ++s) {
      wj[s] = ok[s] ? std::exp(wj[s] - top) : 0.f;
      total += wj[s];
    }
    const float inv = 1.f / total;  // total > 0: a row sees at least one column (its own, written this step)
    int64_t s = 0;
    if (vs) {  // a value's scale: its weight
      for (; s < whole; s += 8)
        _mm256_storeu_ps(wj + s, _mm256_mul_ps(_mm256_loadu_ps(wj + s), _mm256_mul_ps(_mm256_set1_ps(inv),
                         _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(vs + s))))));
      for (; s < span; ++s) wj[s] *= inv * static_cast<float>(vs[s]);
    } else {
      for (; s < whole; s += 8) _mm256_storeu_ps(wj + s, _mm256_mul_ps(_mm256_loadu_ps(wj + s), _mm256_set1_ps(inv)));
      for (; s < span; ++s) wj[s] *= inv;
    }
  }
}

// q times 8 consecutive columns of k (each n floats, n a multiple of 8) -> out[0..7]: eight independent sums
static inline void eight_dots(const float* q, const float* k, int64_t n, float* out) {
  __m256 a[8];
  for (int c = 0; c < 8; ++c) a[c] = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 x = _mm256_loadu_ps(q + i);
    for (int c = 0; c < 8; ++c) a[c] = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + c * n + i), a[c]);
  }
  // pairs added within 128-bit halves, then the halves: the eight sums in order
  const __m256 lo = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 hi = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31)));
}

// A run of n tokens of one cache row at consecutive columns (a prompt chunk; a decode token is a run of one), one
// key/value head: token t's G query heads at q + t * q_step (G * D floats), its span columns[t] + 1, its scores at
// w + t * w_step (G rows of its span), its result (G, D) at out + t * out_step. The columns are taken a tile at a
// time and, inside a tile, the tokens one after the other: the tile's keys and values are read from memory once for
// the run, then from the processor's nearest cache. A token's arithmetic does not depend on the run: the tiles start
// at column 0 for every token and end at its own span, each score and weighted sum is added in the same order, so a
// chunk gives, bit for bit, what its tokens give one at a time.
constexpr int64_t COLUMN_TILE = 64;  // columns a tile (64 float keys of 64 numbers: 16 KiB)

struct Run {
  const float* q; int64_t q_step;
  const int64_t* columns; int64_t n;
  float* w; int64_t w_step;
  float* out; int64_t out_step;
  int64_t widest() const { return columns[n - 1] + 1; }  // columns rise along a run
};

// A float cache: one query head at a time (8 columns' sums at once, then 64 numbers of the head in 8 registers).
// Measured on the course's machine faster than the tiles below for float keys up to 1,024 tokens and 8 rows (a
// head's keys and values stay in the processor's cache between its query heads there); at 4,096 tokens, one row,
// the tiles were a few percent faster. A lone token (a decode row) takes its whole span as one tile: 64-column tiles
// cost it more (8 rows at 600 columns, one thread: 31-32 ms against 29-31), and a tile's bounds, multiples of 8,
// change none of its sums. A run of a chunk's tokens takes 64 columns at a time (16 tokens at 1,000 columns, one
// thread: 39-40 ms against 44-45 one token after another, 2026-12-07).
static void attend_per_head(const Run& r, const float* kb, const float* vb, const bool* ok, int64_t G, int64_t D,
                            float scale) {
  const int64_t widest = r.widest(), tile = r.n == 1 ? widest : COLUMN_TILE;  // one token: its whole span
  for (int64_t a = 0; a < widest; a += tile) {
    for (int64_t t = 0; t < r.n; ++t) {
      const int64_t span = r.columns[t] + 1, z = std::min(span, a + tile);
      const float* q = r.q + t * r.q_step;
      float* w = r.w + t * r.w_step;
      for (int64_t j = 0; j < G; ++j) {  // a tile's start is a multiple of 8: its 8-column sums as the whole span's
        int64_t s = a;
        for (; s + 8 <= z; s += 8) eight_dots(q + j * D, kb + s * D, D, w + j * span + s);
        for (; s < z; ++s) w[j * span + s] = dot(q + j * D, kb + s * D, D);
      }
    }
  }
  for (int64_t t = 0; t < r.n; ++t) {
    softmax_rows(r.w + t * r.w_step, nullptr, nullptr, ok, r.columns[t] + 1, G, scale);
    std::fill(r.out + t * r.out_step, r.out + t * r.out_step + G * D, 0.f);
  }
  for (int64_t a = 0; a < widest; a += tile) {
    for (int64_t t = 0; t < r.n; ++t) {
      const int64_t span = r.columns[t] + 1, z = std::min(span, a + tile);
      for (int64_t j = 0; j < G; ++j) {
        const float* wj = r.w + t * r.w_step + j * span;
        float* o = r.out + t * r.out_step + j * D;
        int64_t d0 = 0;
        for (; d0 + 64 <= D; d0 += 64) {  // the sums go on from the last tile's (stored, loaded: the same numbers)
          __m256 acc[8];
          for (int c = 0; c < 8; ++c) acc[c] = _mm256_loadu_ps(o + d0 + 8 * c);
          for (int64_t s = a; s < z; ++s) {
            if (!ok[s]) continue;  // never read: its weight is 0, and 0 times an unwritten number may not be
            const __m256 ws = _mm256_set1_ps(wj[s]);
            for (int c = 0; c < 8; ++c) acc[c] = _mm256_fmadd_ps(ws, _mm256_loadu_ps(vb + s * D + d0 + 8 * c), acc[c]);
          }
          for (int c = 0; c < 8; ++c) _mm256_storeu_ps(o + d0 + 8 * c, acc[c]);
        }
        for (; d0 < D; d0 += 8) {  // the last 8..56 numbers of a head whose size is not a multiple of 64
          __m256 acc = _mm256_loadu_ps(o + d0);
          for (int64_t s = a; s < z; ++s)
            if (ok[s]) acc = _mm256_fmadd_ps(_mm256_set1_ps(wj[s]), _mm256_loadu_ps(vb + s * D + d0), acc);
          _mm256_storeu_ps(o + d0, acc);
        }
      }
    }
  }
}

// The scores of a tile of columns [a, z) for the G query heads at once (G a constant: each key is loaded, and an
// 8-bit one converted, once for all G heads; 4 columns x G heads of independent sums)
template <int G, typename T>
static inline void tile_scores(const float* q, const T* kb, int64_t a, int64_t z, int64_t span, int64_t D, float* w) {
  int64_t s = a;
  for (; s + 4 <= z; s += 4) {
    __m256 acc[G][4];
    for (int j = 0; j < G; ++j)
      for (int c = 0; c < 4; ++c) acc[j][c] = _mm256_setzero_ps();
    for (int64_t i = 0; i < D; i += 8) {
      __m256 k[4];
      for (int c = 0; c < 4; ++c) k[c] = load8(kb + (s + c) * D + i);
      for (int j = 0; j < G; ++j) {
        const __m256 x = _mm256_loadu_ps(q + j * D + i);
        for (int c = 0; c < 4; ++c) acc[j][c] = _mm256_fmadd_ps(x, k[c], acc[j][c]);
      }
    }
    for (int j = 0; j < G; ++j) {  // the four sums of head j: pairs added within 128-bit halves, then the halves
      const __m256 sums = _mm256_hadd_ps(_mm256_hadd_ps(acc[j][0], acc[j][1]), _mm256_hadd_ps(acc[j][2], acc[j][3]));
      _mm_storeu_ps(w + j * span + s, _mm_add_ps(_mm256_castps256_ps128(sums), _mm256_extractf128_ps(sums, 1)));
    }
  }
  for (; s < z; ++s)
    for (int j = 0; j < G; ++j) w[j * span + s] = dot(q + j * D, kb + s * D, D);
}

// out (G, N * 8) += the tile's columns [a, z) of N * 8 numbers of the values (vb: (capacity, D), already offset to
// those numbers) weighted by w (G rows of span): each value loaded, and an 8-bit one converted, once for the G
// heads; N registers of sums per head
template <int G, int N, typename T>
static inline void tile_values(const float* w, const T* vb, const bool* ok, int64_t a, int64_t z, int64_t span,
                               int64_t D, float* out) {
  __m256 acc[G][N];
  for (int j = 0; j < G; ++j)
    for (int c = 0; c < N; ++c) acc[j][c] = _mm256_loadu_ps(out + j * D + 8 * c);
  for (int64_t s = a; s < z; ++s) {
    if (!ok[s]) continue;  // never read: its weight is 0, and 0 times an unwritten number may not be
    __m256 v[N];
    for (int c = 0; c < N; ++c) v[c] = load8(vb + s * D + 8 * c);
    for (int j = 0; j < G; ++j) {
      const __m256 ws = _mm256_set1_ps(w[j * span + s]);
      for (int c = 0; c < N; ++c) acc[j][c] = _mm256_fmadd_ps(ws, v[c], acc[j][c]);
    }
  }
  for (int j = 0; j < G; ++j)
    for (int c = 0; c < N; ++c) _mm256_storeu_ps(out + j * D + 8 * c, acc[j][c]);
}

// the head's numbers 32 at a time (4 registers a head), the last 8, 16 or 24 with fewer
template <int G, typename T>
static inline void tile_all_values(const float* w, const T* vb, const bool* ok, int64_t a, int64_t z, int64_t span,
                                   int64_t D, float* out) {
  for (int64_t d0 = 0; d0 < D; d0 += 32) {
    switch (std::min<int64_t>(32, D - d0) / 8) {
      case 1: tile_values<G, 1>(w, vb + d0, ok, a, z, span, D, out + d0); break;
      case 2: tile_values<G, 2>(w, vb + d0, ok, a, z, span, D, out + d0); break;
      case 3: tile_values<G, 3>(w, vb + d0, ok, a, z, span, D, out + d0); break;
      default: tile_values<G, 4>(w, vb + d0, ok, a, z, span, D, out + d0); break;
    }
  }
}

// An 8-bit or bfloat16 cache: a run's G query heads (G a constant, 1 to 4) a tile of columns at a time for all G,
// so each key and value is loaded and converted to floats once for the G heads (and, inside a tile, read again
// from the nearest cache for the run's next token); ks, vs: an 8-bit cache's scales per column, nullptr otherwise
template <int G, typename T>
static void attend_group(const Run& r, const T* kb, const T* vb, const at::Half* ks, const at::Half* vs,
                         const bool* ok, int64_t D, float scale) {
  const int64_t widest = r.widest();
  for (int64_t a = 0; a < widest; a += COLUMN_TILE)
    for (int64_t t = 0; t < r.n; ++t) {
      const int64_t span = r.columns[t] + 1;
      if (a < span)
        tile_scores<G>(r.q + t * r.q_step, kb, a, std::min(span, a + COLUMN_TILE), span, D, r.w + t * r.w_step);
    }
  for (int64_t t = 0; t < r.n; ++t) {
    softmax_rows(r.w + t * r.w_step, ks, vs, ok, r.columns[t] + 1, G, scale);
    std::fill(r.out + t * r.out_step, r.out + t * r.out_step + G * D, 0.f);
  }
  for (int64_t a = 0; a < widest; a += COLUMN_TILE)
    for (int64_t t = 0; t < r.n; ++t) {
      const int64_t span = r.columns[t] + 1;
      if (a < span)
        tile_all_values<G>(r.w + t * r.w_step, vb, ok, a, std::min(span, a + COLUMN_TILE), span, D,
                           r.out + t * r.out_step);
    }
}

// A float cache: attend_per_head. An 8-bit or bfloat16 cache: attend_group, G a constant for its register plans
// (query heads per key/value head 1 to 4; a model with more takes them in groups of at most 4, each group reading
// the keys and values once)
template <typename T>
static void attend_heads(const Run& r, const T* kb, const T* vb, const at::Half* ks, const at::Half* vs,
                         const bool* ok, int64_t G, int64_t D, float scale) {
  if constexpr (std::is_same<T, float>::value) {
    attend_per_head(r, kb, vb, ok, G, D, scale);
  } else {
    for (int64_t j = 0; j < G; j += 4) {
      const int64_t n = std::min<int64_t>(4, G - j);
      Run part = r;  // query heads j..j+n-1 of each token: their scores in the same room, one group after another
      part.q += j * D;
      part.out += j * D;
      switch (n) {
        case 1: attend_group<1>(part, kb, vb, ks, vs, ok, D, scale); break;
        case 2: attend_group<2>(part, kb, vb, ks, vs, ok, D, scale); break;
        case 3: attend_group<3>(part, kb, vb, ks, vs, ok, D, scale); break;
        default: attend_group<4>(part, kb, vb, ks, vs, ok, D, scale); break;
      }
    }
  }
}

constexpr int64_t RUN_TOKENS = 4;  // a chunk is cut into runs of at most this many tokens (work for every thread)

// attention of every token row and key/value head for one layer, after writing each row's key and value at its
// cache row `rows[b]` and column `columns[b]` (all rows' first: tokens of one prompt chunk in one cache row then see
// each other, each reading only the columns up to its own, which is causal attention): qkv (B, (H + 2 KV) D) rotated;
// K, V (cache rows, KV, capacity, D) float32, bfloat16 or int8, and for an 8-bit cache their scales.
// Consecutive token rows of one cache row at consecutive columns (a chunk) are taken as runs of up to RUN_TOKENS
// (attend_per_head, attend_group: a tile of keys read once for the run), each run and key/value head one piece of
// work for the threads
template <typename T>
static void attend_layer(const float* qkv, T* K, T* V, at::Half* ks, at::Half* vs, const bool* ok, int64_t B,
                         int64_t heads, int64_t KV, int64_t D, int64_t capacity, const int64_t* rows,
                         const int64_t* columns, float* att) {
  const int64_t G = heads / KV, width = (heads + 2 * KV) * D;
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  int64_t widest = 0;
  std::vector<int64_t> starts;  // the first token row of each run
  for (int64_t b = 0; b < B; ++b) {
    widest = std::max(widest, columns[b] + 1);
    const bool goes_on = b > 0 && rows[b] == rows[b - 1] && columns[b] == columns[b - 1] + 1 &&
                         b - starts.back() < RUN_TOKENS;
    if (!goes_on) starts.push_back(b);
    for (int64_t g = 0; g < KV; ++g) {
      const int64_t cell = (rows[b] * KV + g) * capacity + columns[b];
      store_column(K + cell * D, ks ? ks + cell : nullptr, qkv + b * width + (heads + g) * D, D);
      store_column(V + cell * D, vs ? vs + cell : nullptr, qkv + b * width + (heads + KV + g) * D, D);
    }
  }
  const int64_t runs = starts.size();
  starts.push_back(B);
  int64_t longest = 1;
  for (int64_t k = 0; k < runs; ++k) longest = std::max(longest, starts[k + 1] - starts[k]);
  // head by head (g outer, runs inner): the runs of one chunk read the same keys one after the other
  at::parallel_for(0, runs * KV, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> w(longest * G * widest);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t k = i % runs, g = i / runs, b = starts[k], first = (rows[b] * KV + g) * capacity;
      const Run r{qkv + b * width + g * G * D, width, columns + b, starts[k + 1] - b, w.data(), G * widest,
                  att + b * heads * D + g * G * D, heads * D};
      attend_heads(r, K + first * D, V + first * D, ks ? ks + first : nullptr, vs ? vs + first : nullptr,
                   ok + rows[b] * capacity, G, D, scale);
    }
  });
}

// x (B, hidden) float32 after the embedding; per layer 6 tensors in `parts`: attn_norm, qkv, o, mlp_norm, gate_up,
// down (the products packed for block_product); keys and values per layer (cache rows, KV, capacity, D): float32
// or bfloat16, or int8 with `key_scales` and `value_scales` per layer (cache rows, KV, capacity, 1) float16
// (engine.long_context.QuantizedKVCache with 8 bits; empty lists otherwise). Token row b is written at cache row
// rows[b], column columns[b], and attends to that cache row's columns 0..columns[b] where seen (cache rows,
// capacity) is true. cos, sin (B, D): each token's rotation. bf16_products: each product's activations rounded to
// bfloat16 (block_product_bf16, the int4 format) instead of to 8 bits per block (block_product, int4-q8);
// everything between the products stays float32 either way.
// Returns the last block's output (B, hidden): the final norm and head run after it.
static torch::Tensor layers_at(torch::Tensor x, const std::vector<torch::Tensor>& parts,
                               const std::vector<torch::Tensor>& keys, const std::vector<torch::Tensor>& values,
                               const std::vector<torch::Tensor>& key_scales,
                               const std::vector<torch::Tensor>& value_scales, const torch::Tensor& cos,
                               const torch::Tensor& sin, const torch::Tensor& seen, const int64_t* rows,
                               const int64_t* columns, int64_t heads, int64_t kv_heads, double eps,
                               bool bf16_products) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x must be (rows, hidden) float32");
  const int64_t L = static_cast<int64_t>(keys.size()), B = x.size(0), hidden = x.size(1);
  TORCH_CHECK(L > 0 && static_cast<int64_t>(parts.size()) == 6 * L && static_cast<int64_t>(values.size()) == L,
              "six parts and one key and value tensor per layer");
  const bool int8 = !key_scales.empty();
  TORCH_CHECK(int8 ? static_cast<int64_t>(key_scales.size()) == L && static_cast<int64_t>(value_scales.size()) == L
                   : value_scales.empty(), "scales for every layer's keys and values (an 8-bit cache) or for none");
  TORCH_CHECK(keys[0].dim() == 4, "keys and values must be (rows, kv heads, capacity, D)");
  const int64_t KV = kv_heads, D = keys[0].size(3), capacity = keys[0].size(2), cache_rows = keys[0].size(0);
  TORCH_CHECK(D % 8 == 0 && heads % kv_heads == 0, "the head dimension must be a multiple of 8, the query heads of the key/value heads");
  TORCH_CHECK(seen.scalar_type() == torch::kBool && seen.is_contiguous() && seen.size(0) == cache_rows &&
              seen.size(1) == capacity, "seen must be (cache rows, capacity) bool");
  TORCH_CHECK(cos.scalar_type() == torch::kFloat && cos.is_contiguous() && sin.is_contiguous() && cos.size(0) == B &&
              cos.size(1) == D && sin.sizes() == cos.sizes(), "cos and sin must be (rows, D) float32");
  const auto kind = int8 ? torch::kChar : keys[0].scalar_type();
  TORCH_CHECK(int8 || kind == torch::kFloat || kind == torch::kBFloat16,
              "keys and values must be float32, bfloat16 or int8");
  for (int64_t l = 0; l < L; ++l) {
    TORCH_CHECK(keys[l].is_contiguous() && values[l].is_contiguous() && keys[l].scalar_type() == kind &&
                keys[l].size(0) == cache_rows && keys[l].size(1) == KV && keys[l].size(2) == capacity &&
                values[l].scalar_type() == kind && values[l].sizes() == keys[l].sizes() &&
                parts[6 * l].numel() == hidden && parts[6 * l + 3].numel() == hidden,
                "keys and values must be (rows, kv heads, capacity, D), contiguous, one dtype (int8 with scales); "
                "norms of the hidden size");
    if (int8)
      TORCH_CHECK(key_scales[l].is_contiguous() && value_scales[l].is_contiguous() &&
                  key_scales[l].scalar_type() == torch::kHalf && value_scales[l].scalar_type() == torch::kHalf &&
                  key_scales[l].numel() == cache_rows * KV * capacity &&
                  value_scales[l].numel() == cache_rows * KV * capacity,
                  "an 8-bit cache's scales must be (rows, kv heads, capacity, 1) float16, contiguous");
  }
  x = x.clone();
  float* xs = x.data_ptr<float>();
  auto h = torch::empty_like(x);
  float* hs = h.data_ptr<float>();
  const float* cs = cos.data_ptr<float>();
  const float* sn = sin.data_ptr<float>();
  const int64_t width = (heads + 2 * KV) * D;
  auto attended = torch::empty({B, heads * D}, x.options());
  float* att = attended.data_ptr<float>();
  const auto product = [bf16_products](const torch::Tensor& in, const torch::Tensor& w) {
    return bf16_products ? block_product_bf16(in, w) : block_product(in, w);
  };
  for (int64_t l = 0; l < L; ++l) {
    const torch::Tensor* p = parts.data() + 6 * l;
    for (int64_t b = 0; b < B; ++b) rms_norm(xs + b * hidden, p[0].data_ptr<float>(), eps, hidden, hs + b * hidden);
    auto qkv = product(h, p[1]);  // (B, (H + 2 KV) D)
    float* qs = qkv.data_ptr<float>();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < heads + KV; ++i) rotate(qs + b * width + i * D, cs + b * D, sn + b * D, D);
    if (int8)
      attend_layer(qs, keys[l].data_ptr<int8_t>(), values[l].data_ptr<int8_t>(), key_scales[l].data_ptr<at::Half>(),
                   value_scales[l].data_ptr<at::Half>(), seen.data_ptr<bool>(), B, heads, KV, D, capacity, rows,
                   columns, att);
    else if (kind == torch::kBFloat16)
      attend_layer(qs, keys[l].data_ptr<at::BFloat16>(), values[l].data_ptr<at::BFloat16>(), nullptr, nullptr,
                   seen.data_ptr<bool>(), B, heads, KV, D, capacity, rows, columns, att);
    else
      attend_layer(qs, keys[l].data_ptr<float>(), values[l].data_ptr<float>(), nullptr, nullptr,
                   seen.data_ptr<bool>(), B, heads, KV, D, capacity, rows, columns, att);
    auto o = product(attended, p[2]);
    const float* os = o.data_ptr<float>();
    for (int64_t i = 0; i < B * hidden; ++i) xs[i] += os[i];
    for (int64_t b = 0; b < B; ++b) rms_norm(xs + b * hidden, p[3].data_ptr<float>(), eps, hidden, hs + b * hidden);
    auto gu = product(h, p[4]);  // (B, 2 I): gate, then up
    const int64_t I = gu.size(1) / 2;
    TORCH_CHECK(I % 8 == 0, "the feed-forward size must be a multiple of 8");
    auto act = torch::empty({B, I}, x.options());
    const float* gs = gu.data_ptr<float>();
    float* as = act.data_ptr<float>();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < I; i += 8) {  // silu(gate) * up = gate / (1 + e^-gate) * up
        const __m256 g = _mm256_loadu_ps(gs + b * 2 * I + i), u = _mm256_loadu_ps(gs + b * 2 * I + I + i);
        const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
        _mm256_storeu_ps(as + b * I + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), e)), u));
      }
    auto down = product(act, p[5]);
    const float* ds = down.data_ptr<float>();
    for (int64_t i = 0; i < B * hidden; ++i) xs[i] += ds[i];
  }
  return x;
}

// B rows, one token each, all at one column of a cache of B rows (row b writes cache row b): a batch's decode step
torch::Tensor decode_layers(torch::Tensor x, std::vector<torch::Tensor> parts, std::vector<torch::Tensor> keys,
                            std::vector<torch::Tensor> values, std::vector<torch::Tensor> key_scales,
                            std::vector<torch::Tensor> value_scales, torch::Tensor cos, torch::Tensor sin,
                            torch::Tensor seen, int64_t column, int64_t heads, int64_t kv_heads, double eps,
                            bool bf16_products) {
  pybind11::gil_scoped_release no_gil;  // other Python threads run meanwhile (a server's event loop sends tokens)
  TORCH_CHECK(x.dim() == 2 && !keys.empty() && keys[0].dim() == 4 && keys[0].size(0) == x.size(0),
              "x must be (rows, hidden) and keys (rows, kv heads, capacity, D): one token per cache row");
  TORCH_CHECK(column >= 0 && column < keys[0].size(2), "the column must lie inside the cache");
  std::vector<int64_t> rows(x.size(0)), columns(x.size(0), column);
  for (int64_t b = 0; b < x.size(0); ++b) rows[b] = b;
  return layers_at(x, parts, keys, values, key_scales, value_scales, cos, sin, seen, rows.data(), columns.data(),
                   heads, kv_heads, eps, bf16_products);
}

// Tokens of several requests at once (one engine step): token b at cache row rows[b], column columns[b] (int64,
// (B,) each). Decode rows are one token of a cache row; a prompt chunk is several tokens of one cache row at
// consecutive columns. No (row, column) may come twice.
torch::Tensor step_tokens(torch::Tensor x, std::vector<torch::Tensor> parts, std::vector<torch::Tensor> keys,
                          std::vector<torch::Tensor> values, std::vector<torch::Tensor> key_scales,
                          std::vector<torch::Tensor> value_scales, torch::Tensor cos, torch::Tensor sin,
                          torch::Tensor seen, torch::Tensor rows, torch::Tensor columns, int64_t heads,
                          int64_t kv_heads, double eps, bool bf16_products) {
  pybind11::gil_scoped_release no_gil;  // as decode_layers
  TORCH_CHECK(x.dim() == 2 && !keys.empty() && keys[0].dim() == 4, "x must be (tokens, hidden), keys 4-dimensional");
  const int64_t B = x.size(0);
  TORCH_CHECK(rows.scalar_type() == torch::kLong && columns.scalar_type() == torch::kLong && rows.is_contiguous() &&
              columns.is_contiguous() && rows.numel() == B && columns.numel() == B,
              "rows and columns must be (tokens,) int64, one each per token");
  const int64_t* r = rows.data_ptr<int64_t>();
  const int64_t* c = columns.data_ptr<int64_t>();
  std::vector<std::pair<int64_t, int64_t>> cells(B);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(r[b] >= 0 && r[b] < keys[0].size(0) && c[b] >= 0 && c[b] < keys[0].size(2),
                "token ", b, " at row ", r[b], ", column ", c[b], ": outside the cache");
    cells[b] = {r[b], c[b]};
  }
  std::sort(cells.begin(), cells.end());
  TORCH_CHECK(std::adjacent_find(cells.begin(), cells.end()) == cells.end(), "two tokens at one row and column");
  return layers_at(x, parts, keys, values, key_scales, value_scales, cos, sin, seen, r, c, heads, kv_heads, eps,
                   bf16_products);
}
