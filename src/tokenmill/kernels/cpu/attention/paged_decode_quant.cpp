// Paged attention over a quantized KV cache (int8 or fp8 e4m3, one float32 scale per token and kv
// head: value = element * scale), read in place: each row of the cache is widened to float in a
// row-sized buffer as it is used, never the whole context. Every query row is one work item attending
// over its own context length, so a step's decodes and prefill rows go in one call (a prefill row at
// position p is a decode over the first p + 1 positions). K scales multiply the dot products, V scales
// the probabilities. Online softmax per block, float32 accumulation. bf16 queries over an fp8 cache go to
// paged_decode.cpp's bf16-product kernel instead where it runs (tokenmill::paged_decode_fp8_bf16: the codes decoded
// to bf16, keys 16 to a tile in the lanes of its products, so no sum across a vector per key).
//
// Also the quantizing store of a step's K/V (write_kv_quant_), the same arithmetic as
// attention/kv_quant.py's quantize: scale = amax / qmax (1 where amax is 0), element = x / scale
// rounded to nearest even (int8 clamped to +-127, fp8 saturated to +-448).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "avx512.h"
#include "common.h"
#include "kernels.h"

namespace {

const float* fp8_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int i = 0; i < 256; ++i) t[i] = c10::detail::fp8e4m3fn_to_fp32_value(static_cast<uint8_t>(i));
    return t;
  }();
  return table.data();
}

inline void widen(const int8_t* src, float* dst, int64_t n, const float*) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

inline void widen(const uint8_t* src, float* dst, int64_t n, const float* lut) {
  for (int64_t i = 0; i < n; ++i) dst[i] = lut[src[i]];
}

template <typename T>
inline float to_float(T x) { return static_cast<float>(x); }

template <int64_t DIM>
inline float dot(const float* a, const float* b, int64_t n) {
  const int64_t len = DIM > 0 ? DIM : n;
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < len; ++i) acc += a[i] * b[i];
  return acc;
}

template <int64_t DIM>
inline void axpy(float p, const float* x, float* y, int64_t n) {
  const int64_t len = DIM > 0 ? DIM : n;
#pragma omp simd
  for (int64_t i = 0; i < len; ++i) y[i] += p * x[i];
}

struct Shape {
  int64_t rows, hq, hk, dim, bs, max_blocks, window;
  float scale;
};

// T: query/output dtype; E: the cache's element storage (int8_t, or uint8_t bits of fp8 e4m3)
template <typename T, typename E, int64_t DIM>
void attend(const T* q, int64_t q_row_stride, int64_t q_head_stride, const E* kc, const E* vc, const float* ks,
            const float* vs, const int32_t* tables, const int32_t* lens, T* out, const Shape& sh) {
  const int64_t hq = sh.hq, hk = sh.hk, dim = sh.dim, bs = sh.bs, group = hq / hk, row_len = hk * dim;
  const float* lut = fp8_table();
  at::parallel_for(0, sh.rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(hq * dim), acc(hq * dim), row(row_len), s(hq * bs), m(hq), l(hq);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t len = lens[r];
      const int64_t start = sh.window > 0 ? std::max<int64_t>(0, len - sh.window) : 0;
      for (int64_t h = 0; h < hq; ++h)
        for (int64_t d = 0; d < dim; ++d)
          qf[h * dim + d] = to_float(q[r * q_row_stride + h * q_head_stride + d]) * sh.scale;
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.f);
      const int32_t* table = tables + r * sh.max_blocks;
      for (int64_t bi = start / bs; bi * bs < len; ++bi) {
        const int64_t p0 = std::max(start, bi * bs), n = std::min(len, (bi + 1) * bs) - p0;
        const int64_t slot0 = static_cast<int64_t>(table[bi]) * bs + (p0 - bi * bs);
        for (int64_t j = 0; j < n; ++j) {
          const int64_t slot = slot0 + j;
          widen(kc + slot * row_len, row.data(), row_len, lut);
          for (int64_t kh = 0, h = 0; kh < hk; ++kh)
            for (int64_t g = 0; g < group; ++g, ++h)
              s[h * bs + j] = dot<DIM>(qf.data() + h * dim, row.data() + kh * dim, dim) * ks[slot * hk + kh];
        }
        tokenmill::softmax_block(s.data(), bs, n, hq, dim, m.data(), l.data(), acc.data());
        for (int64_t j = 0; j < n; ++j) {
          const int64_t slot = slot0 + j;
          widen(vc + slot * row_len, row.data(), row_len, lut);
          for (int64_t kh = 0, h = 0; kh < hk; ++kh) {
            const float vscale = vs[slot * hk + kh];
            for (int64_t g = 0; g < group; ++g, ++h)
              axpy<DIM>(s[h * bs + j] * vscale, row.data() + kh * dim, acc.data() + h * dim, dim);
          }
        }
      }
      for (int64_t h = 0; h < hq; ++h) {
        const float inv = l[h] > 0.f ? 1.f / l[h] : 0.f;
        for (int64_t d = 0; d < dim; ++d) out[(r * hq + h) * dim + d] = static_cast<T>(acc[h * dim + d] * inv);
      }
    }
  });
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// 16 cached elements from e as float (int8: sign-extended; fp8 e4m3: decoded in registers, the 256-entry table's
// values: a normal code's magnitude bits shifted into a float's exponent and mantissa with the exponent rebiased
// (+120), a subnormal one's (exponent bits 0) 3 mantissa bits times 2^-9, the all-ones magnitude NaN, the sign bit
// moved to the float's)
inline __m512 widen16(const int8_t* e, const float*) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(e))));
}
inline __m512 widen16(const uint8_t* e, const float*) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(e)));
  const __m512i mag = _mm512_and_si512(b, _mm512_set1_epi32(0x7F));
  const __m512 normal = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(mag, 20), _mm512_set1_epi32(120 << 23)));
  const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(mag), _mm512_set1_ps(1.f / 512.f));
  __m512 v = _mm512_mask_blend_ps(_mm512_cmplt_epi32_mask(mag, _mm512_set1_epi32(8)), normal, sub);
  v = _mm512_mask_blend_ps(_mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7F)), v,
                           _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN()));
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(v), sign));
}

// The kv head's row at slot (DIM elements) widened into f; the row `ahead` slots on is prefetched beside it
template <typename E, int64_t DIM>
inline void load_row(const E* cache, int64_t slot, int64_t ahead, int64_t row_len, int64_t kh, const float* lut,
                     __m512* f) {
  const E* row = cache + slot * row_len + kh * DIM;
  _mm_prefetch(reinterpret_cast<const char*>(row + ahead * row_len), _MM_HINT_T0);
  for (int c = 0; c < DIM / 16; ++c) f[c] = widen16(row + c * 16, lut);
}

// The same arithmetic as attend, one work item per (query row, kv head, run of up to NG of its query
// heads): each cached K/V row of the kv head (DIM elements, 64 or 128 bytes) is widened in registers
// once for the NG heads, and the next block's row at the same place is prefetched with each row (blocks
// live anywhere in the pool).
template <typename T, typename E, int64_t DIM, int NG>
void attend_heads(const T* q, int64_t q_row_stride, int64_t q_head_stride, const E* kc, const E* vc,
                  const float* ks, const float* vs, const int32_t* table, int64_t len, int64_t r, int64_t kh,
                  int64_t h0, T* out, const Shape& sh, float* s) {
  constexpr int C = DIM / 16;
  const int64_t hk = sh.hk, bs = sh.bs, row_len = hk * DIM;
  const float* lut = fp8_table();
  alignas(64) float qf[NG][DIM];
  for (int g = 0; g < NG; ++g)
    for (int64_t d = 0; d < DIM; ++d) qf[g][d] = to_float(q[r * q_row_stride + (h0 + g) * q_head_stride + d]) * sh.scale;
  alignas(64) float acc[NG][DIM] = {};
  float m[NG], l[NG];
  for (int g = 0; g < NG; ++g) m[g] = -std::numeric_limits<float>::infinity(), l[g] = 0.f;
  const int64_t start = sh.window > 0 ? std::max<int64_t>(0, len - sh.window) : 0;
  const int64_t last = len > 0 ? (len - 1) / bs : -1;
  for (int64_t bi = start / bs; bi <= last; ++bi) {
    const int64_t p0 = std::max(start, bi * bs), n = std::min(len, (bi + 1) * bs) - p0;
    const int64_t slot0 = static_cast<int64_t>(table[bi]) * bs + (p0 - bi * bs);
    // the next block's rows at the same place, one with each row's loads (as attend_i16)
    const int64_t ahead = (bi < last ? static_cast<int64_t>(table[bi + 1]) * bs + (p0 - bi * bs) : slot0) - slot0;
    // body(j, the block's j-th row of cache widened to float, its scale) over the block's rows
    auto each_row = [&](const E* cache, const float* scales, auto&& body) {
      for (int64_t j = 0; j < n; ++j) {
        const int64_t slot = slot0 + j;
        __m512 f[C];
        load_row<E, DIM>(cache, slot, ahead, row_len, kh, lut, f);
        body(j, f, scales[slot * hk + kh]);
      }
    };
    each_row(kc, ks, [&](int64_t j, const __m512* kf, float kscale) {
      for (int g = 0; g < NG; ++g) {
        __m512 t = _mm512_mul_ps(kf[0], _mm512_load_ps(qf[g]));
        for (int c = 1; c < C; ++c) t = _mm512_fmadd_ps(kf[c], _mm512_load_ps(qf[g] + c * 16), t);
        s[g * bs + j] = _mm512_reduce_add_ps(t) * kscale;
      }
    });
    tokenmill::softmax_block(s, bs, n, NG, DIM, m, l, acc[0]);
    each_row(vc, vs, [&](int64_t j, const __m512* vf, float vscale) {
      for (int g = 0; g < NG; ++g) {
        const __m512 pv = _mm512_set1_ps(s[g * bs + j] * vscale);
        for (int c = 0; c < C; ++c)
          _mm512_store_ps(acc[g] + c * 16, _mm512_fmadd_ps(pv, vf[c], _mm512_load_ps(acc[g] + c * 16)));
      }
    });
  }
  for (int g = 0; g < NG; ++g) {
    const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
    alignas(64) float o[DIM];
    for (int c = 0; c < C; ++c) _mm512_store_ps(o + c * 16, _mm512_mul_ps(_mm512_load_ps(acc[g] + c * 16), _mm512_set1_ps(inv)));
    T* dst = out + (r * sh.hq + h0 + g) * DIM;
    for (int64_t d = 0; d < DIM; ++d) dst[d] = static_cast<T>(o[d]);
  }
}

#if defined(__AVX512VNNI__)
// bf16 queries over an int8 cache in integer arithmetic (vpdpwssd: pairs of int16 products summed into
// int32), in tiles of 16 keys (attend_i16 below):
// - scores: each head's q (times the softmax scale) as 16-bit fixed point, q ~ sq * qi with
//   sq = amax / 32767, within amax * 2^-16 of q (finer than q's own bf16 rounding of its largest
//   elements); K rows widened to int16 in registers; 4 keys' dim pairs side by side (transpose4x4), so
//   that each product leaves a key per lane (as the bf16 kernel's tiles do). Exact in int32, then
//   times sq and the key's scale.
// - values: a tile's weights w = p * (the value's scale) as 16-bit fixed point per tile and head
//   (w ~ sw * wi, sw = max w / 32767), two keys' int16 V rows interleaved per pair of dims; the int32
//   sums (under 2 * 127 * 32767 * 8 per tile) go to the float accumulator times sw after each tile.
constexpr int64_t KTILE = 16;

// 32 int8 at e as int16
inline __m512i widen32(const int8_t* e) {
  return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(e)));
}

// One query head's state over its row's context: q permuted as the bf16 kernel's (qp[c][b] lane (L, k) =
// the q pair 16c + 4L + b), its fixed-point scale, the running max and lane-wise sum of the online softmax,
// and the float accumulator, whose lanes acc[2c][4L + k] and acc[2c + 1][4L + k] hold dims 32c + 8L + k and
// 32c + 8L + 4 + k (the order vpunpck{l,h}wd leave them in).
template <int64_t DIM>
struct HeadI16 {
  __m512i qp[DIM / 32][4];
  __m512 l;
  float sq, m;
  alignas(64) float acc[DIM / 16][16];
};

template <int64_t DIM>
void head_i16_init(HeadI16<DIM>& hs, const at::BFloat16* q, float scale) {
  alignas(64) float x[DIM];
  float amax = 0.f;
  for (int64_t d = 0; d < DIM; ++d) {
    x[d] = static_cast<float>(q[d]) * scale;
    amax = std::max(amax, std::fabs(x[d]));
  }
  hs.sq = std::max(amax, 1e-30f) / 32767.f;
  alignas(64) int16_t qi[DIM];
  for (int64_t d = 0; d < DIM; ++d) qi[d] = static_cast<int16_t>(std::nearbyint(x[d] / hs.sq));
  for (int64_t c = 0; c < DIM / 32; ++c) {
    const __m512i v = _mm512_load_si512(qi + c * 32);
    for (int b = 0; b < 4; ++b)
      hs.qp[c][b] = _mm512_permutexvar_epi32(
          _mm512_add_epi32(_mm512_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12), _mm512_set1_epi32(b)), v);
  }
  hs.l = _mm512_setzero_ps();
  hs.m = -std::numeric_limits<float>::infinity();
  for (auto& a : hs.acc) std::fill(a, a + 16, 0.f);
}

// bit l of bits moved to bit l * stride (2 or 4)
__attribute__((always_inline)) inline __mmask16 spread(uint32_t bits, int stride) {
  if (bits == (1u << (16 / stride)) - 1) return static_cast<__mmask16>(stride == 2 ? 0x5555u : 0x1111u);  // all
  uint32_t m = 0;
  for (int l = 0; bits != 0; ++l, bits >>= 1) m |= (bits & 1u) << (l * stride);
  return static_cast<__mmask16>(m);
}

// The scales of a tile's n <= 16 keys for one kv head, p[j * hk] for j < n, as 16 lanes (0 past n). One to four
// kv heads: the tile's rows of scales loaded (masked to the lanes wanted, so never past the pool) and picked out
// with permutes; more: a gather.
__attribute__((always_inline)) inline __m512 tile_scales(const float* p, int64_t hk, int64_t n) {
  const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
  if (hk == 1) return _mm512_maskz_loadu_ps(valid, p);
  if (hk == 2) {
    const __mmask16 lo = spread(valid & 0xFFu, 2);
    const __mmask16 hi = spread(valid >> 8, 2);
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    return _mm512_permutex2var_ps(_mm512_maskz_loadu_ps(lo, p), even, _mm512_maskz_loadu_ps(hi, p + 16));
  }
  if (hk == 4) {
    __m512 z[4];
    for (int i = 0; i < 4; ++i)
      z[i] = _mm512_maskz_loadu_ps(spread((valid >> (4 * i)) & 0xFu, 4), p + 16 * i);
    const __m512i fourth = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
    return _mm512_shuffle_f32x4(_mm512_permutex2var_ps(z[0], fourth, z[1]), _mm512_permutex2var_ps(z[2], fourth, z[3]),
                                0x44);
  }
  const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                         _mm512_set1_epi32(static_cast<int32_t>(hk)));
  return _mm512_mask_i32gather_ps(_mm512_setzero_ps(), valid, idx, p, 4);
}

// NG query heads of one kv head over a tile of n <= 16 keys: K rows kt + j * row_len, V rows vt + j * row_len,
// their scales ks[j * hk], vs[j * hk]; rows to prefetch (one per key) while the tile is worked on: kpf / vpf into
// L1 (the next block's rows at the same place), kfar / vfar into L2 (the block after next's).
template <int64_t DIM, int NG>
void tile_i16(HeadI16<DIM>* hs, const int8_t* kt, const int8_t* vt, int64_t row_len, int64_t n, const float* ks,
              const float* vs, int64_t hk, const char* kpf, const char* vpf, const char* kfar, const char* vfar) {
  constexpr int NV = DIM / 32;  // zmm of int16 per row
  const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
  // scores, 4 keys at a time (a): si[g] lane (L, k) sums key 4a + k over the dims of lane L; each pair of groups'
  // sums folded as it is done (half[g][0]: keys 0-7, half[g][1]: keys 8-15), so that few sums live at once
  __m512i half[NG][2], first[NG];
  for (int a = 0; a < 4; ++a) {
    __m512i si[NG];
    for (int g = 0; g < NG; ++g) si[g] = _mm512_setzero_si512();
    for (int c = 0; c < NV; ++c) {
      __m512i x[4], u[4];
      for (int k = 0; k < 4; ++k) {
        const int64_t j = 4 * a + k;
        if (c == 0) _mm_prefetch(kpf + j * row_len, _MM_HINT_T0);
        if (c == 0) _mm_prefetch(kfar + j * row_len, _MM_HINT_T1);
        x[k] = j < n ? widen32(kt + j * row_len + c * 32) : _mm512_setzero_si512();
      }
      tokenmill::transpose4x4(x, u);
      for (int b = 0; b < 4; ++b)
        for (int g = 0; g < NG; ++g) si[g] = _mm512_dpwssd_epi32(si[g], u[b], hs[g].qp[c][b]);
    }
    for (int g = 0; g < NG; ++g) {
      if (a % 2 == 0) {
        first[g] = si[g];
      } else {
        half[g][a / 2] = _mm512_add_epi32(_mm512_shuffle_i32x4(first[g], si[g], 0x44),
                                          _mm512_shuffle_i32x4(first[g], si[g], 0xee));
      }
    }
  }
  const __m512 kscale = tile_scales(ks, hk, n);
  const __m512 vscale = tile_scales(vs, hk, n);
  alignas(64) int32_t wpair[NG][KTILE / 2];
  float sw[NG];
  for (int g = 0; g < NG; ++g) {
    const __m512i m01 = half[g][0], m23 = half[g][1];
    const __m512i tot = _mm512_add_epi32(_mm512_shuffle_i32x4(m01, m23, 0x88), _mm512_shuffle_i32x4(m01, m23, 0xdd));
    const __m512 sc = _mm512_mul_ps(_mm512_cvtepi32_ps(tot), _mm512_mul_ps(kscale, _mm512_set1_ps(hs[g].sq)));
    float corr;
    const __m512 w = _mm512_mul_ps(tokenmill::tile_softmax(sc, valid, hs[g].m, hs[g].l, corr), vscale);
    if (corr != 1.f) {
      const __m512 cv = _mm512_set1_ps(corr);
      for (auto& a : hs[g].acc) _mm512_store_ps(a, _mm512_mul_ps(_mm512_load_ps(a), cv));
    }
    const float wmax = _mm512_reduce_max_ps(w);  // w >= 0
    sw[g] = wmax / 32767.f;
    // (no branch on wmax: where it is 0 every w is, and so is every wi)
    const __m512i wi = _mm512_cvtps_epi32(_mm512_mul_ps(w, _mm512_set1_ps(32767.f / std::max(wmax, 1e-30f))));
    _mm256_store_si256(reinterpret_cast<__m256i*>(wpair[g]), _mm512_cvtepi32_epi16(wi));
  }
  // values: two keys' rows interleaved per pair of dims, each head's pair of weights broadcast
  __m512i pi[NG][2 * NV];
  for (int g = 0; g < NG; ++g)
    for (int i = 0; i < 2 * NV; ++i) pi[g][i] = _mm512_setzero_si512();
  for (int64_t j = 0; j < n; j += 2) {
    __m512i wv[NG];
    for (int g = 0; g < NG; ++g) wv[g] = _mm512_set1_epi32(wpair[g][j / 2]);
    _mm_prefetch(vpf + j * row_len, _MM_HINT_T0);
    _mm_prefetch(vpf + (j + 1) * row_len, _MM_HINT_T0);
    _mm_prefetch(vfar + j * row_len, _MM_HINT_T1);
    _mm_prefetch(vfar + (j + 1) * row_len, _MM_HINT_T1);
    for (int c = 0; c < NV; ++c) {
      const __m512i a = widen32(vt + j * row_len + c * 32);
      const __m512i b = j + 1 < n ? widen32(vt + (j + 1) * row_len + c * 32) : _mm512_setzero_si512();
      const __m512i lo = _mm512_unpacklo_epi16(a, b), hi = _mm512_unpackhi_epi16(a, b);
      for (int g = 0; g < NG; ++g) {
        pi[g][2 * c] = _mm512_dpwssd_epi32(pi[g][2 * c], lo, wv[g]);
        pi[g][2 * c + 1] = _mm512_dpwssd_epi32(pi[g][2 * c + 1], hi, wv[g]);
      }
    }
  }
  for (int g = 0; g < NG; ++g) {
    const __m512 sv = _mm512_set1_ps(sw[g]);
    for (int i = 0; i < 2 * NV; ++i)
      _mm512_store_ps(hs[g].acc[i], _mm512_fmadd_ps(_mm512_cvtepi32_ps(pi[g][i]), sv, _mm512_load_ps(hs[g].acc[i])));
  }
}

// count K and V scales from slot's on (none where slot < 0) toward the cache level HINT names; the caller passes
// the current block's count for the next ones (only a context's last block is shorter)
template <_mm_hint HINT>
inline void prefetch_scales(const float* ks, const float* vs, int64_t slot, int64_t count, int64_t hk) {
  if (slot < 0) return;
  for (int64_t off = 0; off < count; off += 16) {
    _mm_prefetch(reinterpret_cast<const char*>(ks + slot * hk + off), HINT);
    _mm_prefetch(reinterpret_cast<const char*>(vs + slot * hk + off), HINT);
  }
}

// The integer path's work: one item per query row, or per (row, part of its kv heads) where rows are too few
// to keep every thread busy. Each tile of 16 keys is taken for all kv heads of the item in turn, so that a
// token's K and V rows are read whole, once; the next block's rows at the same place are prefetched one at
// a time with this tile's loads (a burst of a whole block's prefetches stalls the loads needed now), into
// L1, and the block after next's into L2. The K and V scales of those two blocks, which the tiles' gathers
// read, are prefetched as each block starts.
template <int64_t DIM>
void attend_i16(const at::BFloat16* q, int64_t q_row_stride, int64_t q_head_stride, const int8_t* kc, const int8_t* vc,
                const float* ks, const float* vs, const int32_t* tables, const int32_t* lens, at::BFloat16* out,
                const Shape& sh) {
  constexpr int NGMAX = DIM == 64 ? 4 : 2;  // heads whose int32 sums stay in registers
  const int64_t hq = sh.hq, hk = sh.hk, bs = sh.bs, group = hq / hk, row_len = hk * DIM;
  const int64_t parts = std::clamp<int64_t>((2 * at::get_num_threads() + sh.rows - 1) / std::max<int64_t>(sh.rows, 1),
                                            1, hk);
  at::parallel_for(0, sh.rows * parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<HeadI16<DIM>> hs(hq);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / parts, part = item % parts;
      const int64_t kh0 = part * hk / parts, kh1 = (part + 1) * hk / parts, len = lens[r];
      for (int64_t h = kh0 * group; h < kh1 * group; ++h)
        head_i16_init(hs[h], q + r * q_row_stride + h * q_head_stride, sh.scale);
      const int32_t* table = tables + r * sh.max_blocks;
      const int64_t start = sh.window > 0 ? std::max<int64_t>(0, len - sh.window) : 0;
      const int64_t last = len > 0 ? (len - 1) / bs : -1;
      for (int64_t bi = start / bs; bi <= last; ++bi) {
        const int64_t p0 = std::max(start, bi * bs), rows = std::min(len, (bi + 1) * bs) - p0;
        const int64_t slot0 = static_cast<int64_t>(table[bi]) * bs + (p0 - bi * bs);
        const int64_t next = bi < last ? static_cast<int64_t>(table[bi + 1]) * bs + (p0 - bi * bs) : -1;
        const int64_t next2 = bi + 1 < last ? static_cast<int64_t>(table[bi + 2]) * bs + (p0 - bi * bs) : -1;
        prefetch_scales<_MM_HINT_T1>(ks, vs, next2, rows * hk, hk);
        prefetch_scales<_MM_HINT_T0>(ks, vs, next, rows * hk, hk);
        for (int64_t t = 0; t < rows; t += KTILE) {
          const int64_t n = std::min(KTILE, rows - t), slot = slot0 + t;
          for (int64_t kh = kh0; kh < kh1; ++kh) {
            const int64_t here = slot * row_len + kh * DIM, ahead = next >= 0 ? (next + t) * row_len + kh * DIM : here;
            const int64_t far = next2 >= 0 ? (next2 + t) * row_len + kh * DIM : ahead;
            const char *kpf = reinterpret_cast<const char*>(kc + ahead), *vpf = reinterpret_cast<const char*>(vc + ahead);
            const char *kfar = reinterpret_cast<const char*>(kc + far), *vfar = reinterpret_cast<const char*>(vc + far);
            for (int64_t g = 0; g < group; g += NGMAX) {
              HeadI16<DIM>* hg = hs.data() + kh * group + g;
              const float *ksp = ks + slot * hk + kh, *vsp = vs + slot * hk + kh;
              switch (std::min<int64_t>(NGMAX, group - g)) {
                case 1: tile_i16<DIM, 1>(hg, kc + here, vc + here, row_len, n, ksp, vsp, hk, kpf, vpf, kfar, vfar); break;
                case 2: tile_i16<DIM, 2>(hg, kc + here, vc + here, row_len, n, ksp, vsp, hk, kpf, vpf, kfar, vfar); break;
                case 3: tile_i16<DIM, NGMAX < 3 ? 1 : 3>(hg, kc + here, vc + here, row_len, n, ksp, vsp, hk, kpf, vpf, kfar, vfar); break;
                default: tile_i16<DIM, NGMAX>(hg, kc + here, vc + here, row_len, n, ksp, vsp, hk, kpf, vpf, kfar, vfar); break;
              }
            }
          }
        }
      }
      for (int64_t h = kh0 * group; h < kh1 * group; ++h) {
        const float sum = _mm512_reduce_add_ps(hs[h].l);
        const float inv = sum > 0.f ? 1.f / sum : 0.f;
        at::BFloat16* dst = out + (r * hq + h) * DIM;
        for (int64_t c = 0; c < DIM / 32; ++c)
          for (int half = 0; half < 2; ++half)
            for (int L = 0; L < 4; ++L)
              for (int k = 0; k < 4; ++k)
                dst[32 * c + 8 * L + 4 * half + k] = static_cast<at::BFloat16>(hs[h].acc[2 * c + half][4 * L + k] * inv);
      }
    }
  });
}
#endif

// attend with the work split over (query row, kv head, run of query heads); DIM 64 or 128
template <typename T, typename E, int64_t DIM>
void attend_vec(const T* q, int64_t q_row_stride, int64_t q_head_stride, const E* kc, const E* vc, const float* ks,
                const float* vs, const int32_t* tables, const int32_t* lens, T* out, const Shape& sh) {
  constexpr int NGMAX = DIM == 64 ? 4 : 2;  // NG * DIM / 16 accumulators in registers
  const int64_t group = sh.hq / sh.hk, runs = (group + NGMAX - 1) / NGMAX;
  at::parallel_for(0, sh.rows * sh.hk * runs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s(NGMAX * sh.bs);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / (sh.hk * runs), kh = (i / runs) % sh.hk, run = i % runs;
      const int64_t h0 = kh * group + run * NGMAX, ng = std::min<int64_t>(NGMAX, group - run * NGMAX);
      const int32_t* table = tables + r * sh.max_blocks;
      switch (ng) {
#define TM_HEADS(N)                                                                                              \
  case N:                                                                                                        \
    attend_heads<T, E, DIM, (N <= NGMAX ? N : 1)>(q, q_row_stride, q_head_stride, kc, vc, ks, vs, table, lens[r], \
                                                  r, kh, h0, out, sh, s.data());                                 \
    break;
        TM_HEADS(1)
        TM_HEADS(2)
        TM_HEADS(3)
        TM_HEADS(4)
#undef TM_HEADS
      }
    }
  });
}
#endif

template <typename T, typename E>
void dispatch_dim(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& ks,
                  const at::Tensor& vs, const at::Tensor& tables, const at::Tensor& lens, at::Tensor& out,
                  const Shape& sh) {
  if constexpr (std::is_same_v<T, at::BFloat16> && std::is_same_v<E, uint8_t>) {  // bf16 over fp8: bf16 products
    if (tokenmill::paged_decode_fp8_bf16(
            reinterpret_cast<const uint16_t*>(q.data_ptr<T>()), q.stride(0), q.stride(1),
            static_cast<const uint8_t*>(kc.data_ptr()), static_cast<const uint8_t*>(vc.data_ptr()),
            ks.data_ptr<float>(), vs.data_ptr<float>(), tables.data_ptr<int32_t>(), lens.data_ptr<int32_t>(),
            reinterpret_cast<uint16_t*>(out.data_ptr<T>()), sh.rows, sh.hq, sh.hk, sh.dim, sh.bs, sh.max_blocks,
            sh.scale, sh.window))
      return;
  }
#if defined(__AVX512F__) && defined(__AVX512BW__)
#if defined(__AVX512VNNI__)
  if constexpr (std::is_same_v<T, at::BFloat16> && std::is_same_v<E, int8_t>) {
    if (sh.dim == 64 || sh.dim == 128) {  // bf16 queries over int8: the integer path
      auto ikernel = sh.dim == 64 ? attend_i16<64> : attend_i16<128>;
      ikernel(q.data_ptr<T>(), q.stride(0), q.stride(1), static_cast<const E*>(kc.data_ptr()),
              static_cast<const E*>(vc.data_ptr()), ks.data_ptr<float>(), vs.data_ptr<float>(),
              tables.data_ptr<int32_t>(), lens.data_ptr<int32_t>(), out.data_ptr<T>(), sh);
      return;
    }
  }
#endif
  auto kernel = sh.dim == 64 ? attend_vec<T, E, 64> : sh.dim == 128 ? attend_vec<T, E, 128> : attend<T, E, 0>;
#else
  auto kernel = sh.dim == 64 ? attend<T, E, 64> : sh.dim == 128 ? attend<T, E, 128> : attend<T, E, 0>;
#endif
  kernel(q.data_ptr<T>(), q.stride(0), q.stride(1), static_cast<const E*>(kc.data_ptr()),
         static_cast<const E*>(vc.data_ptr()), ks.data_ptr<float>(), vs.data_ptr<float>(), tables.data_ptr<int32_t>(),
         lens.data_ptr<int32_t>(), out.data_ptr<T>(), sh);
}

template <typename T>
void dispatch_cache(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& ks,
                    const at::Tensor& vs, const at::Tensor& tables, const at::Tensor& lens, at::Tensor& out,
                    const Shape& sh) {
  if (kc.scalar_type() == at::kChar) dispatch_dim<T, int8_t>(q, kc, vc, ks, vs, tables, lens, out, sh);
  else dispatch_dim<T, uint8_t>(q, kc, vc, ks, vs, tables, lens, out, sh);
}

at::Tensor paged_attention_quant(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                 const at::Tensor& k_scales, const at::Tensor& v_scales, const at::Tensor& block_tables,
                                 const at::Tensor& seq_lens, double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(k_scales.sizes() == k_cache.sizes().slice(0, 3) && v_scales.sizes() == k_scales.sizes(),
              "scales must be [num_blocks, block_size, kv_heads]");
  TORCH_CHECK(q.stride(2) == 1 && k_cache.is_contiguous() && v_cache.is_contiguous() && k_scales.is_contiguous() &&
                  v_scales.is_contiguous(), "need contiguous");
  const auto cdt = k_cache.scalar_type();
  TORCH_CHECK((cdt == at::kChar || cdt == at::kFloat8_e4m3fn) && v_cache.scalar_type() == cdt,
              "paged_attention_quant: the cache must be int8 or float8_e4m3fn");
  TORCH_CHECK(k_scales.scalar_type() == at::kFloat && v_scales.scalar_type() == at::kFloat, "scales must be float32");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt, "need int32");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == q.size(0) && seq_lens.numel() == q.size(0),
              "one block table and one length per query row");
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  const Shape sh{q.size(0), q.size(1), k_cache.size(2), q.size(2), k_cache.size(1), tables.size(1), window,
                 static_cast<float>(scale)};
  TORCH_CHECK(sh.hq % sh.hk == 0 && k_cache.size(3) == sh.dim, "head shapes do not match");
  const int64_t num_blocks = k_cache.size(0);
  const int32_t* t = tables.data_ptr<int32_t>();
  const int32_t* n = lens.data_ptr<int32_t>();
  for (int64_t r = 0; r < sh.rows; ++r) {  // a bad table must not read outside the pool
    TORCH_CHECK(n[r] >= 0 && n[r] <= sh.max_blocks * sh.bs, "context length past the block table");
    for (int64_t b = 0; b * sh.bs < n[r]; ++b)
      TORCH_CHECK(t[r * sh.max_blocks + b] >= 0 && t[r * sh.max_blocks + b] < num_blocks, "block id out of range");
  }
  auto out = at::empty(q.sizes(), q.options());
  switch (q.scalar_type()) {
    case at::kFloat: dispatch_cache<float>(q, k_cache, v_cache, k_scales, v_scales, tables, lens, out, sh); break;
    case at::kBFloat16:
      dispatch_cache<at::BFloat16>(q, k_cache, v_cache, k_scales, v_scales, tables, lens, out, sh);
      break;
    case at::kHalf: dispatch_cache<at::Half>(q, k_cache, v_cache, k_scales, v_scales, tables, lens, out, sh); break;
    default: TORCH_CHECK(false, "paged_attention_quant: unsupported query dtype ", q.scalar_type());
  }
  return out;
}

// x [t, hk, dim] (rows may be strided, each head's values contiguous) -> cache rows at slots, scales beside
template <typename T, typename E>
void quantize_rows(const at::Tensor& x, at::Tensor& cache, at::Tensor& scales, const int64_t* slots) {
  const int64_t t = x.size(0), hk = x.size(1), dim = x.size(2);
  const T* src = x.data_ptr<T>();
  E* dst = static_cast<E*>(cache.data_ptr());
  float* sc = scales.data_ptr<float>();
  const bool is_int8 = std::is_same_v<E, int8_t>;
  const float qmax = is_int8 ? 127.f : 448.f;
  at::parallel_for(0, t * hk, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / hk, h = i % hk;
      const T* xs = src + r * x.stride(0) + h * x.stride(1);
      float amax = 0.f;
      for (int64_t d = 0; d < dim; ++d) amax = std::max(amax, std::abs(to_float(xs[d])));
      const float s = amax > 0.f ? amax / qmax : 1.f;
      E* out = dst + (slots[r] * hk + h) * dim;
      for (int64_t d = 0; d < dim; ++d) {
        const float y = std::min(std::max(to_float(xs[d]) / s, -qmax), qmax);
        if constexpr (std::is_same_v<E, int8_t>) out[d] = static_cast<int8_t>(std::nearbyint(y));
        else out[d] = c10::Float8_e4m3fn(y).x;
      }
      sc[slots[r] * hk + h] = s;
    }
  });
}

void write_kv_quant_(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
                     at::Tensor& k_scales, at::Tensor& v_scales, const at::Tensor& slot_mapping) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.stride(2) == 1 && v.stride(2) == 1, "bad k/v");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_scales.is_contiguous() &&
                  v_scales.is_contiguous(), "need contiguous caches");
  TORCH_CHECK(k_cache.size(2) == k.size(1) && k_cache.size(3) == k.size(2), "k/v do not match the cache's heads");
  TORCH_CHECK(k_scales.scalar_type() == at::kFloat && v_scales.scalar_type() == at::kFloat, "scales must be float32");
  auto slots = slot_mapping.to(at::kLong).contiguous();
  TORCH_CHECK(slots.numel() == k.size(0), "one slot per row");
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < slots.numel(); ++i) TORCH_CHECK(sp[i] >= 0 && sp[i] < num_slots, "slot out of range");
  const auto cdt = k_cache.scalar_type();
  TORCH_CHECK((cdt == at::kChar || cdt == at::kFloat8_e4m3fn) && v_cache.scalar_type() == cdt,
              "write_kv_quant_: the cache must be int8 or float8_e4m3fn");
  auto run = [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    if (cdt == at::kChar) {
      quantize_rows<T, int8_t>(k, k_cache, k_scales, sp);
      quantize_rows<T, int8_t>(v, v_cache, v_scales, sp);
    } else {
      quantize_rows<T, uint8_t>(k, k_cache, k_scales, sp);
      quantize_rows<T, uint8_t>(v, v_cache, v_scales, sp);
    }
  };
  switch (k.scalar_type()) {
    case at::kFloat: run(static_cast<float*>(nullptr)); break;
    case at::kBFloat16: run(static_cast<at::BFloat16*>(nullptr)); break;
    case at::kHalf: run(static_cast<at::Half*>(nullptr)); break;
    default: TORCH_CHECK(false, "write_kv_quant_: unsupported dtype ", k.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def("paged_attention_quant(Tensor q, Tensor k_cache, Tensor v_cache, Tensor k_scales, Tensor v_scales, "
        "Tensor block_tables, Tensor seq_lens, float scale, int window) -> Tensor");
  m.def("write_kv_quant_(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor(c!) k_scales, "
        "Tensor(d!) v_scales, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(tokenmill_cpu, CPU, m) {
  m.impl("paged_attention_quant", &paged_attention_quant);
  m.impl("write_kv_quant_", &write_kv_quant_);
}
