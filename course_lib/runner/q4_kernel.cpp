// The course's 4-bit kernel, read and built by q4_kernel.py (torch.utils.cpp_extension.load_inline).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
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

static inline float dot(const float* a, const float* b, int64_t n) {  // n a multiple of 8
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  __m128 sum = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  sum = _mm_hadd_ps(sum, sum);
  return _mm_cvtss_f32(_mm_hadd_ps(sum, sum));
}

// q times 4 consecutive rows of k (each n long, n a multiple of 8) -> out[0..3]: four independent sums, so the
// multiply-adds do not wait on each other
static inline void dot4(const float* q, const float* k, int64_t n, float* out) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 x = _mm256_loadu_ps(q + i);
    a0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + i), a0);
    a1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + n + i), a1);
    a2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 2 * n + i), a2);
    a3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 3 * n + i), a3);
  }
  const __m256 sums = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(sums), _mm256_extractf128_ps(sums, 1)));
}

static void rotate(float* x, const float* cos, const float* sin, int64_t D) {  // pairs (i, i + D/2), as apply_rotary
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    x[i] = a * cos[i] - b * sin[i];
    x[i + half] = b * cos[i + half] + a * sin[i + half];
  }
}

// x (B, hidden) float32 after the embedding; per layer 6 tensors in `parts`: attn_norm, qkv, o, mlp_norm, gate_up,
// down (the products packed for block_product); keys and values per layer (B, KV, capacity, D) float32, this
// step's column written; cos, sin (B, D); seen (B, capacity) bool: the columns each row may read (only columns up to
// `column` are read at all). Returns the last block's output (B, hidden): the final norm and head run after it.
torch::Tensor decode_layers(torch::Tensor x, std::vector<torch::Tensor> parts, std::vector<torch::Tensor> keys,
                            std::vector<torch::Tensor> values, torch::Tensor cos, torch::Tensor sin, torch::Tensor seen,
                            int64_t column, int64_t heads, int64_t kv_heads, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x must be (rows, hidden) float32");
  const int64_t L = static_cast<int64_t>(keys.size()), B = x.size(0), hidden = x.size(1);
  TORCH_CHECK(L > 0 && static_cast<int64_t>(parts.size()) == 6 * L && static_cast<int64_t>(values.size()) == L,
              "six parts and one key and value tensor per layer");
  const int64_t KV = kv_heads, G = heads / kv_heads, D = keys[0].size(3), capacity = keys[0].size(2);
  TORCH_CHECK(column >= 0 && column < capacity, "the column must lie inside the cache");
  TORCH_CHECK(D % 8 == 0 && heads % kv_heads == 0, "the head dimension must be a multiple of 8, the query heads of the key/value heads");
  TORCH_CHECK(seen.scalar_type() == torch::kBool && seen.is_contiguous() && seen.size(0) == B && seen.size(1) == capacity,
              "seen must be (rows, capacity) bool");
  TORCH_CHECK(cos.scalar_type() == torch::kFloat && cos.is_contiguous() && sin.is_contiguous() && cos.size(0) == B &&
              cos.size(1) == D && sin.sizes() == cos.sizes(), "cos and sin must be (rows, D) float32");
  for (int64_t l = 0; l < L; ++l)
    TORCH_CHECK(keys[l].is_contiguous() && values[l].is_contiguous() && keys[l].scalar_type() == torch::kFloat &&
                keys[l].size(0) == B && keys[l].size(1) == KV && keys[l].size(2) == capacity,
                values[l].scalar_type() == torch::kFloat && values[l].sizes() == keys[l].sizes() &&
                parts[6 * l].numel() == hidden && parts[6 * l + 3].numel() == hidden,
                "keys and values must be (rows, kv heads, capacity, D) float32, contiguous; norms of the hidden size");
  x = x.clone();
  float* xs = x.data_ptr<float>();
  auto h = torch::empty_like(x);
  float* hs = h.data_ptr<float>();
  const float* cs = cos.data_ptr<float>();
  const float* sn = sin.data_ptr<float>();
  const bool* ok = seen.data_ptr<bool>();
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  const int64_t width = (heads + 2 * KV) * D, span = column + 1;
  auto attended = torch::empty({B, heads * D}, x.options());
  float* att = attended.data_ptr<float>();
  for (int64_t l = 0; l < L; ++l) {
    const torch::Tensor* p = parts.data() + 6 * l;
    for (int64_t b = 0; b < B; ++b) rms_norm(xs + b * hidden, p[0].data_ptr<float>(), eps, hidden, hs + b * hidden);
    auto qkv = block_product(h, p[1]);  // (B, (H + 2 KV) D)
    float* qs = qkv.data_ptr<float>();
    float* K = keys[l].data_ptr<float>();
    float* V = values[l].data_ptr<float>();
    for (int64_t b = 0; b < B; ++b) {
      float* row = qs + b * width;
      for (int64_t i = 0; i < heads + KV; ++i) rotate(row + i * D, cs + b * D, sn + b * D, D);
      for (int64_t g = 0; g < KV; ++g) {
        std::memcpy(K + ((b * KV + g) * capacity + column) * D, row + (heads + g) * D, D * sizeof(float));
        std::memcpy(V + ((b * KV + g) * capacity + column) * D, row + (heads + KV + g) * D, D * sizeof(float));
      }
    }
    // attention: per row and key/value head, its G query heads together, so each key and value is read once
    at::parallel_for(0, B * KV, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> w(G * span);
      for (int64_t bg = begin; bg < end; ++bg) {
        const int64_t b = bg / KV, g = bg % KV;
        const float* q = qs + b * width + g * G * D;  // (G, D): query heads g G .. g G + G - 1
        const float* kb = K + (b * KV + g) * capacity * D;
        const float* vb = V + (b * KV + g) * capacity * D;
        const bool* okb = ok + b * capacity;
        std::vector<float> top(G, -INFINITY), total(G, 0.f);
        for (int64_t j = 0; j < G; ++j) {
          float* wj = w.data() + j * span;
          int64_t s = 0;
          for (; s + 4 <= span; s += 4) dot4(q + j * D, kb + s * D, D, wj + s);  // four columns' chains at once
          for (; s < span; ++s) wj[s] = dot(q + j * D, kb + s * D, D);
          for (s = 0; s < span; ++s) {
            wj[s] = okb[s] ? wj[s] * scale : -INFINITY;
            top[j] = std::max(top[j], wj[s]);
          }
        }
        for (int64_t j = 0; j < G; ++j) {
          float* wj = w.data() + j * span;
          int64_t s = 0;
          for (; s + 8 <= span; s += 8)
            _mm256_storeu_ps(wj + s, exp8(_mm256_sub_ps(_mm256_loadu_ps(wj + s), _mm256_set1_ps(top[j]))));
          for (; s < span; ++s) wj[s] = std::exp(wj[s] - top[j]);
          for (s = 0; s < span; ++s) {
            wj[s] = okb[s] ? wj[s] : 0.f;  // a hidden column weighs nothing, exactly
            total[j] += wj[s];
          }
        }
        float* out = att + b * heads * D + g * G * D;  // (G, D)
        std::fill(out, out + G * D, 0.f);
        for (int64_t s = 0; s < span; ++s) {
          if (!okb[s]) continue;
          for (int64_t j = 0; j < G; ++j) {  // total > 0: a row sees at least one column, or its weights are all 0
            const __m256 ws = _mm256_set1_ps(w[j * span + s] / total[j]);
            for (int64_t d = 0; d < D; d += 8)
              _mm256_storeu_ps(out + j * D + d, _mm256_fmadd_ps(ws, _mm256_loadu_ps(vb + s * D + d),
                                                                _mm256_loadu_ps(out + j * D + d)));
          }
        }
      }
    });
    auto o = block_product(attended, p[2]);
    const float* os = o.data_ptr<float>();
    for (int64_t i = 0; i < B * hidden; ++i) xs[i] += os[i];
    for (int64_t b = 0; b < B; ++b) rms_norm(xs + b * hidden, p[3].data_ptr<float>(), eps, hidden, hs + b * hidden);
    auto gu = block_product(h, p[4]);  // (B, 2 I): gate, then up
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
    auto down = block_product(act, p[5]);
    const float* ds = down.data_ptr<float>();
    for (int64_t i = 0; i < B * hidden; ++i) xs[i] += ds[i];
  }
  return x;
}
