// The course's 4-bit kernel, read and built by q4_kernel.py (torch.utils.cpp_extension.load_inline).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
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

// R rows (at most 4) times one tile of 8 outputs, over all K/32 blocks
template <int R, int KIND>
static inline void tile_rows(const uint8_t* w, int64_t blocks, const int8_t* q, const float* sc, const float* su,
                             int64_t K, __m256* acc) {
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  (void)ones;  // the VNNI build adds its byte products without it
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* wb = w + b * block_bytes(KIND);
    __m256i sums[R];
    for (int r = 0; r < R; ++r) sums[r] = _mm256_setzero_si256();
    if (KIND != Q8) {
      for (int i = 0; i < 4; ++i) {
        const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * i));
        const __m256i lo = _mm256_and_si256(packed, low), hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
        for (int r = 0; r < R; ++r) {
          const int8_t* a = q + r * K + 32 * b + 4 * i;
          int32_t a_lo, a_hi;
          std::memcpy(&a_lo, a, 4);
          std::memcpy(&a_hi, a + 16, 4);
#ifdef COURSE_VNNI  // one instruction: 4 byte products added into each 32-bit lane
          sums[r] = _mm256_dpbusd_epi32(sums[r], lo, _mm256_set1_epi32(a_lo));
          sums[r] = _mm256_dpbusd_epi32(sums[r], hi, _mm256_set1_epi32(a_hi));
#else     // 16-bit lanes: pairs of products (at most 2 * 15 * 127), 8 such added (at most 30,480 < 32,767)
          sums[r] = _mm256_add_epi16(sums[r], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(a_lo)));
          sums[r] = _mm256_add_epi16(sums[r], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(a_hi)));
#endif
        }
      }
#ifndef COURSE_VNNI
      for (int r = 0; r < R; ++r) sums[r] = _mm256_madd_epi16(sums[r], ones);
#endif
    } else {
      for (int c = 0; c < 8; ++c) {
        const __m256i wc = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * c));
        const __m256i size = _mm256_sign_epi8(wc, wc);  // maddubs wants its first operand unsigned: |w| and a * sign(w)
        for (int r = 0; r < R; ++r) {
          int32_t a4;
          std::memcpy(&a4, q + r * K + 32 * b + 4 * c, 4);
#ifdef COURSE_VNNI
          sums[r] = _mm256_dpbusd_epi32(sums[r], size, _mm256_sign_epi8(_mm256_set1_epi32(a4), wc));
#else
          const __m256i pairs = _mm256_maddubs_epi16(size, _mm256_sign_epi8(_mm256_set1_epi32(a4), wc));
          sums[r] = _mm256_add_epi32(sums[r], _mm256_madd_epi16(pairs, ones));  // pairs reach 2 * 127 * 127: to 32 bits now
#endif
        }
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + (KIND == Q8 ? 256 : 128))));
    for (int r = 0; r < R; ++r)
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r]), _mm256_mul_ps(d, _mm256_set1_ps(sc[r * (K / 32) + b])), acc[r]);
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
    __m256 acc[4];
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t r0 = 0; r0 < M; r0 += 4) {
        const int rows = static_cast<int>(std::min<int64_t>(4, M - r0));
        const int8_t* qr = q.data() + r0 * K;
        const float *scr = sc.data() + r0 * blocks, *sur = su.data() + r0 * blocks;
        const uint8_t* wt = ws + t * tile_bytes;
        switch (rows) {
          case 1: tile_rows<1, KIND>(wt, blocks, qr, scr, sur, K, acc); break;
          case 2: tile_rows<2, KIND>(wt, blocks, qr, scr, sur, K, acc); break;
          case 3: tile_rows<3, KIND>(wt, blocks, qr, scr, sur, K, acc); break;
          default: tile_rows<4, KIND>(wt, blocks, qr, scr, sur, K, acc); break;
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
