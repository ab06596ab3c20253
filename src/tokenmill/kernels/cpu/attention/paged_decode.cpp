// Paged decode attention for CPUs: one query token per sequence attends to its context read in
// place from the paged KV cache (no gather copy). Work items are (sequence, kv head) pairs, run
// in parallel; the query heads of a GQA group share each K/V row load. Online softmax per
// block of keys, accumulated in float32.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
#if defined(__AVX2__)
#include "avx2.h"
#endif

#include "avx512.h"
#include "common.h"
#include "kernels.h"

namespace {

inline void load_row(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }

inline void load_row(const at::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits = static_cast<uint32_t>(s[i]) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    dst[i] = f;
  }
}

inline void load_row(const at::Half* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

inline void store_row(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }

template <typename T>
inline void store_row(const float* src, T* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

template <typename T>
inline void prefetch(const T* p, int64_t n) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < n * static_cast<int64_t>(sizeof(T)); off += 64) __builtin_prefetch(c + off, 0, 1);
}

// DIM > 0 fixes the head size at compile time (fully unrolled); 0 means "use n".
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

// Visits a sequence's context [start, len) block by block: fn(base, n, next) gets the element offset of the
// block's first row (all kv heads of a row are contiguous), the row count, and the offset of the next block's
// first row (-1 for the last block), for a caller that prefetches the next block a row at a time as it works
template <typename Fn>
inline void for_each_block_next(const int32_t* table, int64_t bs, int64_t row_len, int64_t start, int64_t len,
                                Fn&& fn) {
  for (int64_t bi = start / bs; bi * bs < len; ++bi) {
    const int64_t p0 = std::max(start, bi * bs), n = std::min(len, (bi + 1) * bs) - p0;
    const int64_t next = (bi + 1) * bs < len ? table[bi + 1] * bs * row_len : -1;
    fn((table[bi] * bs + (p0 - bi * bs)) * row_len, n, next);
  }
}

// for_each_block_next with fn(base, n): the next block's K and V are prefetched whole before fn works on this
// one, since blocks live anywhere in the pool
template <typename T, typename Fn>
inline void for_each_block(const int32_t* table, const T* kc, const T* vc, int64_t bs, int64_t row_len,
                           int64_t start, int64_t len, Fn&& fn) {
  for_each_block_next(table, bs, row_len, start, len, [&](int64_t base, int64_t n, int64_t next) {
    if (next >= 0) {
      prefetch(kc + next, bs * row_len);
      prefetch(vc + next, bs * row_len);
    }
    fn(base, n);
  });
}

inline void reset(std::vector<float>& acc, std::vector<float>& m, std::vector<float>& l) {
  std::fill(acc.begin(), acc.end(), 0.f);
  std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
  std::fill(l.begin(), l.end(), 0.f);
}

inline void normalize(float* acc, const float* l, int64_t hq, int64_t dim) {
  for (int64_t h = 0; h < hq; ++h) {
    const float inv = l[h] > 0.f ? 1.f / l[h] : 0.f;
    for (int64_t d = 0; d < dim; ++d) acc[h * dim + d] *= inv;
  }
}

template <typename T, int64_t DIM>
void decode(const T* q, int64_t q_seq_stride, int64_t q_head_stride, const T* kc, const T* vc, const int32_t* tables, const int32_t* lens, T* out,
            int64_t num_seqs, int64_t hq, int64_t hk, int64_t dim, int64_t bs, int64_t max_blocks,
            float scale, int64_t window) {
  // One work item per sequence: each cache block's K (then V) rows for all kv heads are one
  // contiguous run of bs * hk * dim elements, streamed in order.
  const int64_t group = hq / hk, row_len = hk * dim;
  at::parallel_for(0, num_seqs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(hq * dim), acc(hq * dim), row(row_len), s(hq * bs), m(hq), l(hq);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t len = lens[b];
      const int64_t start = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      for (int64_t h = 0; h < hq; ++h) load_row(q + b * q_seq_stride + h * q_head_stride, qf.data() + h * dim, dim);
      for (int64_t i = 0; i < hq * dim; ++i) qf[i] *= scale;
      reset(acc, m, l);
      for_each_block(tables + b * max_blocks, kc, vc, bs, row_len, start, len, [&](int64_t base, int64_t n) {
        for (int64_t j = 0; j < n; ++j) {
          load_row(kc + base + j * row_len, row.data(), row_len);
          for (int64_t kh = 0, h = 0; kh < hk; ++kh)
            for (int64_t g = 0; g < group; ++g, ++h)
              s[h * bs + j] = dot<DIM>(qf.data() + h * dim, row.data() + kh * dim, dim);
        }
        tokenmill::softmax_block(s.data(), bs, n, hq, dim, m.data(), l.data(), acc.data());
        for (int64_t j = 0; j < n; ++j) {
          load_row(vc + base + j * row_len, row.data(), row_len);
          for (int64_t kh = 0, h = 0; kh < hk; ++kh)
            for (int64_t g = 0; g < group; ++g, ++h)
              axpy<DIM>(s[h * bs + j], row.data() + kh * dim, acc.data() + h * dim, dim);
        }
      });
      normalize(acc.data(), l.data(), hq, dim);
      store_row(acc.data(), out + b * hq * dim, hq * dim);
    }
  });
}

// decode<T, DIM> with the head size fixed at compile time where it is 64 or 128
template <typename T>
void decode_any_dim(const T* q, int64_t q_seq_stride, int64_t q_head_stride, const T* kc, const T* vc,
                    const int32_t* tables, const int32_t* lens, T* out, int64_t num_seqs, int64_t hq, int64_t hk,
                    int64_t dim, int64_t bs, int64_t max_blocks, float scale, int64_t window) {
  auto kernel = dim == 64 ? decode<T, 64> : dim == 128 ? decode<T, 128> : decode<T, 0>;
  kernel(q, q_seq_stride, q_head_stride, kc, vc, tables, lens, out, num_seqs, hq, hk, dim, bs, max_blocks, scale,
         window);
}

#if defined(__AVX2__) && defined(__FMA__)
#define TOKENMILL_F32_AVX2 1
// the four sums of a, b, c, d
inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

using tokenmill::hsum8;

// float32 caches with a head size that is a multiple of 64, on AVX2: decode<float, DIM>'s blocks, online softmax
// (softmax_block) and order of keys, with the K and V rows read in place, each key scored against four heads of
// its GQA group at a time (one load of the key for four products), and each head's output accumulated in
// registers, 64 columns at a time, over a block's V rows.
template <int64_t DIM>
void decode_f32_avx2(const float* q, int64_t q_seq_stride, int64_t q_head_stride, const float* kc, const float* vc,
                     const int32_t* tables, const int32_t* lens, float* out, int64_t num_seqs, int64_t hq, int64_t hk,
                     int64_t bs, int64_t max_blocks, float scale, int64_t window) {
  static_assert(DIM % 64 == 0, "64 columns at a time");
  constexpr int64_t NV = DIM / 8;  // vectors a head row
  const int64_t group = hq / hk, row_len = hk * DIM;
  at::parallel_for(0, num_seqs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(hq * DIM), acc(hq * DIM), s(hq * bs), m(hq), l(hq);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t len = lens[b];
      const int64_t start = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      for (int64_t h = 0; h < hq; ++h) {
        const float* qh = q + b * q_seq_stride + h * q_head_stride;
        for (int64_t d = 0; d < DIM; ++d) qf[h * DIM + d] = qh[d] * scale;
      }
      reset(acc, m, l);
      for_each_block_next(tables + b * max_blocks, bs, row_len, start, len, [&](int64_t base, int64_t n,
                                                                                int64_t next) {
        for (int64_t kh = 0; kh < hk; ++kh) {
          const float* qg = qf.data() + kh * group * DIM;
          float* sg = s.data() + kh * group * bs;
          for (int64_t j = 0; j < n; ++j) {
            if (next >= 0) {  // the next block's K and V rows of this head, a row per key scored
              prefetch(kc + next + j * row_len + kh * DIM, DIM);
              prefetch(vc + next + j * row_len + kh * DIM, DIM);
            }
            const float* k = kc + base + j * row_len + kh * DIM;
            int64_t g = 0;
            for (; g + 4 <= group; g += 4) {
              __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
              const float* q0 = qg + g * DIM;
              for (int64_t v = 0; v < NV; ++v) {
                const __m256 kv = _mm256_loadu_ps(k + 8 * v);
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + 8 * v), kv, a0);
                a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + DIM + 8 * v), kv, a1);
                a2 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + 2 * DIM + 8 * v), kv, a2);
                a3 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + 3 * DIM + 8 * v), kv, a3);
              }
              alignas(16) float four[4];
              _mm_store_ps(four, hsum4(a0, a1, a2, a3));
              for (int64_t i = 0; i < 4; ++i) sg[(g + i) * bs + j] = four[i];
            }
            for (; g < group; ++g) {
              __m256 a = _mm256_setzero_ps();
              for (int64_t v = 0; v < NV; ++v) {
                a = _mm256_fmadd_ps(_mm256_loadu_ps(qg + g * DIM + 8 * v), _mm256_loadu_ps(k + 8 * v), a);
              }
              sg[g * bs + j] = hsum8(a);
            }
          }
        }
        tokenmill::softmax_block(s.data(), bs, n, hq, DIM, m.data(), l.data(), acc.data());
        for (int64_t h = 0; h < hq; ++h) {
          const float* vh = vc + base + (h / group) * DIM;
          const float* p = s.data() + h * bs;
          for (int64_t d0 = 0; d0 < DIM; d0 += 64) {
            float* a = acc.data() + h * DIM + d0;
            __m256 r[8];
            for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(a + 8 * i);
            for (int64_t j = 0; j < n; ++j) {
              const __m256 pj = _mm256_set1_ps(p[j]);
              const float* v = vh + j * row_len + d0;
              for (int i = 0; i < 8; ++i) r[i] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + 8 * i), r[i]);
            }
            for (int i = 0; i < 8; ++i) _mm256_storeu_ps(a + 8 * i, r[i]);
          }
        }
      });
      normalize(acc.data(), l.data(), hq, DIM);
      store_row(acc.data(), out + b * hq * DIM, hq * DIM);
    }
  });
}
#endif


#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define TOKENMILL_DPBF16 1
// bf16 caches on CPUs with AVX512-BF16. Keys are taken in tiles of up to 16 rows, one per zmm
// lane, per kv head: the tile's K slice is transposed once into pairs of dims per key, so that
// vdpbf16ps with a broadcast pair of q yields 16 scores at a time for every head of the GQA group
// (no horizontal sums); the online softmax runs on those vectors; the V rows are accumulated into
// float registers for all heads of the group. A head's float accumulator keeps even and odd
// columns apart (widening bf16 pairs then needs no shuffle); they are interleaved again when the
// result is written.
// The same code reads an fp8 e4m3 cache (E = uint8_t, the codes; one float32 scale per slot and kv head): each 32
// codes are decoded to bf16 in a register as they are loaded (every e4m3 value is a bf16 value), the K scales
// multiply a tile's scores before the softmax and the V scales its probabilities before they are rounded to bf16.
constexpr int64_t TILE = 16;
using tokenmill::exp16;
using tokenmill::tile_softmax;
using tokenmill::transpose4x4;


// Software prefetch, spread over the work of a tile one row at a time (bursts of whole blocks stall the
// loads needed now): a near copy into L1 about 8 KiB ahead and a far one into L2 eight kv-head slices
// ahead, since blocks live anywhere in the pool and the hardware prefetchers stop at page ends.
constexpr int NEAR = 3, FAR = 1;
constexpr int64_t FAR_SLICES = 8;

template <int64_t NV, int HINT, typename E>
inline void prefetch_row(const E* p) {
  for (int64_t off = 0; off < NV * 32 * static_cast<int64_t>(sizeof(E)); off += 64)
    __builtin_prefetch(reinterpret_cast<const char*>(p) + off, 0, HINT);
}

// 32 cached elements at e as bf16 in one register: a bf16 cache's as stored
__attribute__((always_inline)) inline __m512i load32(const at::BFloat16* e) { return _mm512_loadu_si512(e); }

// bf16 bits of an e4m3 magnitude m (7 bits, the sign apart): a normal one's exponent rebiased (+120) above its 3
// mantissa bits; a subnormal one (exponent bits 0) is (m & 7) * 2^-9; all ones is NaN
constexpr uint16_t fp8_magnitude_bf16(int m) {
  const int e = m >> 3, f = m & 7;
  if (m == 0x7F) return 0x7FC0;
  if (e > 0) return static_cast<uint16_t>(((e + 120) << 7) | (f << 4));
  if (f == 0) return 0;
  const int p = f >= 4 ? 2 : f >= 2 ? 1 : 0;  // f = 2^p * (1 + rest)
  return static_cast<uint16_t>(((118 + p) << 7) | ((f << (7 - p)) & 0x7F));
}

struct Fp8Magnitudes {
  alignas(64) uint16_t bits[128];
  constexpr Fp8Magnitudes() : bits{} {
    for (int m = 0; m < 128; ++m) bits[m] = fp8_magnitude_bf16(m);
  }
};
alignas(64) constexpr Fp8Magnitudes kFp8Magnitudes{};

// an fp8 e4m3 cache's 32 codes decoded exactly: each magnitude looked up in the table above (two 64-entry
// permutes, by bit 6), the sign bit moved to bf16's
__attribute__((always_inline)) inline __m512i load32(const uint8_t* e) {
  const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(e)));
  const uint16_t* t = kFp8Magnitudes.bits;
  const __m512i low = _mm512_permutex2var_epi16(_mm512_load_si512(t), b, _mm512_load_si512(t + 32));
  const __m512i high = _mm512_permutex2var_epi16(_mm512_load_si512(t + 64), b, _mm512_load_si512(t + 96));
  const __m512i v = _mm512_mask_blend_epi16(_mm512_test_epi16_mask(b, _mm512_set1_epi16(0x40)), low, high);
  // v | (b << 8 & 0x8000)
  return _mm512_ternarylogic_epi32(v, _mm512_slli_epi16(b, 8), _mm512_set1_epi16(static_cast<int16_t>(0x8000)), 0xF8);
}

// Raw scores without a full transpose: a chunk's 16 rows (16 dim pairs each) are transposed only
// within 128-bit lanes, 4 rows at a time (two in-lane unpack levels), so that kt[c * 16 + 4a + b] holds
// in lane (L, k) pair 4L + b of key 4a + k. vdpbf16ps against q permuted the same way (qp[(h * NV + c)
// * 4 + b], lane (L, k) = pair c * 16 + 4L + b) leaves in acc[h][a] lane (L, k) the part over lane L's
// pairs of key 4a + k; the four 128-bit lanes are summed at the end (keys come out in order). This
// saves the cross-lane half of the transpose and the broadcasts, and keeps the keys in registers.
template <int NH>
__attribute__((always_inline)) inline void finish_scores(__m512 (*acc)[4], float* s) {
  for (int h = 0; h < NH; ++h) {
    const __m512 m01 = _mm512_add_ps(_mm512_shuffle_f32x4(acc[h][0], acc[h][1], 0x44),
                                     _mm512_shuffle_f32x4(acc[h][0], acc[h][1], 0xee));
    const __m512 m23 = _mm512_add_ps(_mm512_shuffle_f32x4(acc[h][2], acc[h][3], 0x44),
                                     _mm512_shuffle_f32x4(acc[h][2], acc[h][3], 0xee));
    _mm512_storeu_ps(s + h * TILE, _mm512_add_ps(_mm512_shuffle_f32x4(m01, m23, 0x88),
                                                 _mm512_shuffle_f32x4(m01, m23, 0xdd)));
  }
}


// Scores of NH <= 4 heads (qp: their permuted q) from the K rows in memory; kt, if given, keeps the
// lane-transposed rows for further heads.
template <int64_t NV, int NH, bool FULL, typename E>
inline void heads_scores_load(const __m512i* qp, const E* k, int64_t row_len, int64_t n, float* s, const E* pf,
                              const E* far, const E* far_v, __m512i* kt) {
  // without a prefetch target, prefetch the rows being read (no branches in the unrolled code)
  if (!pf) pf = k;
  if (!far) far = k;
  if (!far_v) far_v = k;
  __m512 acc[NH][4];
  for (int h = 0; h < NH; ++h)
    for (int a = 0; a < 4; ++a) acc[h][a] = _mm512_setzero_ps();
#pragma GCC unroll 4
  for (int64_t c = 0; c < NV; ++c)
    for (int a = 0; a < 4; ++a) {  // rolled: faster than unrolled when the rows come from DRAM
      __m512i x[4], u[4];
      for (int r = 0; r < 4; ++r) {
        const int64_t j = 4 * a + r;
        if (!FULL && j >= n) { x[r] = _mm512_setzero_si512(); continue; }
        if (c == 0) prefetch_row<NV, NEAR>(pf + j * row_len);
        if (c == 0) prefetch_row<NV, FAR>(far + j * row_len);
        if (c == NV - 1) prefetch_row<NV, FAR>(far_v + j * row_len);
        x[r] = load32(k + j * row_len + c * 32);
      }
      // keeps each group's loads and prefetches between the previous and the next group's work, as
      // written: bunched up front they slow the DRAM-bound case
      asm volatile("" ::: "memory");
      transpose4x4(x, u);
      if (kt)
        for (int b = 0; b < 4; ++b) kt[c * 16 + 4 * a + b] = u[b];
      for (int b = 0; b < 4; ++b)
        for (int h = 0; h < NH; ++h)
          acc[h][a] = _mm512_dpbf16_ps(acc[h][a], (__m512bh)qp[(h * NV + c) * 4 + b], (__m512bh)u[b]);
    }
  finish_scores<NH>(acc, s);
}

// Scores of NH <= 4 more heads from the lane-transposed rows kept in kt.
template <int64_t NV, int NH>
inline void heads_scores_kept(const __m512i* qp, const __m512i* kt, float* s) {
  __m512 acc[NH][4];
  for (int h = 0; h < NH; ++h)
    for (int a = 0; a < 4; ++a) acc[h][a] = _mm512_setzero_ps();
#pragma GCC unroll 4
  for (int64_t c = 0; c < NV; ++c)
#pragma GCC unroll 4
    for (int a = 0; a < 4; ++a)
      for (int b = 0; b < 4; ++b)
        for (int h = 0; h < NH; ++h)
          acc[h][a] = _mm512_dpbf16_ps(acc[h][a], (__m512bh)qp[(h * NV + c) * 4 + b], (__m512bh)kt[c * 16 + 4 * a + b]);
  finish_scores<NH>(acc, s);
}

// Raw scores of a GQA group's heads against the tile's keys (rows k + j * row_len, j < n) into
// s[g * TILE + j]. qp: the heads' permuted q (see heads_scores_load).
// Prefetches: pf (near) and far of the K rows with the first chunk's loads, far_v (the V rows of the far
// slice) with the last chunk's: issuing the far V prefetches here rather than in group_pv spreads the
// long DRAM misses more evenly over a slice's work, which is faster on scattered blocks.
template <int64_t NV, bool FULL, typename E>
inline void group_scores(const __m512i* qp, const E* k, int64_t row_len, int64_t n, int64_t group, float* s,
                         const E* pf, const E* far, const E* far_v) {
  switch (group) {
    case 1: heads_scores_load<NV, 1, FULL>(qp, k, row_len, n, s, pf, far, far_v, nullptr); return;
    case 2: heads_scores_load<NV, 2, FULL>(qp, k, row_len, n, s, pf, far, far_v, nullptr); return;
    case 3: heads_scores_load<NV, 3, FULL>(qp, k, row_len, n, s, pf, far, far_v, nullptr); return;
    case 4: heads_scores_load<NV, 4, FULL>(qp, k, row_len, n, s, pf, far, far_v, nullptr); return;
    default: break;
  }
  __m512i kt[NV * 16];
  heads_scores_load<NV, 4, FULL>(qp, k, row_len, n, s, pf, far, far_v, kt);
  for (int64_t h = 4; h < group; h += 4) {
    const __m512i* qh = qp + h * NV * 4;
    float* sh = s + h * TILE;
    switch (std::min<int64_t>(4, group - h)) {
      case 1: heads_scores_kept<NV, 1>(qh, kt, sh); break;
      case 2: heads_scores_kept<NV, 2>(qh, kt, sh); break;
      case 3: heads_scores_kept<NV, 3>(qh, kt, sh); break;
      default: heads_scores_kept<NV, 4>(qh, kt, sh); break;
    }
  }
}


// tile_softmax for NH heads at once (their exp chains interleave): scores p[g * TILE ...] times scale (a
// vector: per key, where the keys have scales of their own) -> probabilities in place, with the heads' running m,
// l and corr.
template <int NH>
inline void heads_softmax(float* p, __m512 scale, __mmask16 valid, float* m, __m512* l, float* corr) {
  __m512 s[NH];
  for (int g = 0; g < NH; ++g) s[g] = _mm512_mul_ps(_mm512_loadu_ps(p + g * TILE), scale);
  for (int g = 0; g < NH; ++g) _mm512_storeu_ps(p + g * TILE, tile_softmax(s[g], valid, m[g], l[g], corr[g]));
}

// acc[h] = acc[h] * corr[h] + sum_j p[h][j] v[j] for NH heads over NC 32-column chunks from c0, in
// registers across the tile's n V rows (v + j * row_len). Two rows at a time: their columns interleaved in
// pairs (vpunpck{l,h}wd), against each head's two probabilities rounded to bf16 (vdpbf16ps: the products of
// the bf16 pairs summed in float32), as the prefill kernel rounds P. A chunk's accumulators keep its columns
// in the order the unpacks leave them: acc[32c + 4L + i] is column 8L + i, acc[32c + 16 + 4L + i] column
// 8L + 4 + i (store_heads puts them back in order). vscale: the tile's V scales (an fp8 cache's), which multiply
// the probabilities before they are rounded, or null.
template <int64_t DIM, int NH, int NC, typename E>
inline void tile_pv(float* acc, const float* p, const float* corr, const E* v, int64_t row_len, int64_t n,
                    int64_t c0, const E* pf, const E* far, const float* vscale) {
  __m512 alo[NH][NC], ahi[NH][NC];
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < NC; ++c) {
      const __m512 f = _mm512_set1_ps(corr[h]);
      alo[h][c] = _mm512_mul_ps(f, _mm512_loadu_ps(acc + h * DIM + (c0 + c) * 32));
      ahi[h][c] = _mm512_mul_ps(f, _mm512_loadu_ps(acc + h * DIM + (c0 + c) * 32 + 16));
    }
  // each head's probabilities as bf16, pair j / 2 of rows j and j + 1 in one dword (0 past n, as p is)
  alignas(32) uint32_t pp[NH][TILE / 2];
  const __m512 vs = vscale ? _mm512_loadu_ps(vscale) : _mm512_set1_ps(1.f);
  for (int h = 0; h < NH; ++h)
    _mm256_store_si256(reinterpret_cast<__m256i*>(pp[h]),
                       (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(vs, _mm512_loadu_ps(p + h * TILE))));
  for (int64_t j = 0; j < n; j += 2) {
    const bool second = j + 1 < n;
    if (pf) prefetch_row<DIM / 32, NEAR>(pf + j * row_len);
    if (far) prefetch_row<DIM / 32, FAR>(far + j * row_len);
    if (pf && second) prefetch_row<DIM / 32, NEAR>(pf + (j + 1) * row_len);
    if (far && second) prefetch_row<DIM / 32, FAR>(far + (j + 1) * row_len);
    const E* va = v + j * row_len + c0 * 32;
    const E* vb = v + (j + 1) * row_len + c0 * 32;
    __m512bh w[NH];
    for (int h = 0; h < NH; ++h) w[h] = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[h][j / 2]));
    for (int c = 0; c < NC; ++c) {
      const __m512i a = load32(va + c * 32);
      const __m512i b = second ? load32(vb + c * 32) : _mm512_setzero_si512();
      const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(a, b), hi = (__m512bh)_mm512_unpackhi_epi16(a, b);
      for (int h = 0; h < NH; ++h) {
        alo[h][c] = _mm512_dpbf16_ps(alo[h][c], lo, w[h]);
        ahi[h][c] = _mm512_dpbf16_ps(ahi[h][c], hi, w[h]);
      }
    }
  }
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < NC; ++c) {
      _mm512_storeu_ps(acc + h * DIM + (c0 + c) * 32, alo[h][c]);
      _mm512_storeu_ps(acc + h * DIM + (c0 + c) * 32 + 16, ahi[h][c]);
    }
}

// NH heads at once, in column chunks small enough that the accumulators stay in registers.
template <int64_t DIM, int NH, typename E>
inline void heads_pv(float* acc, const float* p, const float* corr, const E* v, int64_t row_len, int64_t n,
                     const E* pf, const E* far, const float* vscale) {
  constexpr int NV = DIM / 32;
  constexpr int NC = NV % 4 == 0 && NH <= 3 ? 4 : NV % 2 == 0 && NH <= 6 ? 2 : 1;
  for (int c0 = 0; c0 < NV; c0 += NC)
    tile_pv<DIM, NH, NC>(acc, p, corr, v, row_len, n, c0, c0 == 0 ? pf : nullptr, c0 == 0 ? far : nullptr, vscale);
}

template <int64_t DIM, typename E>
void group_pv(float* acc, const float* p, const float* corr, const E* v, int64_t row_len, int64_t n, int64_t group,
              const E* pf, const E* far, const float* vscale) {
  for (int64_t h = 0; h < group; h += 8) {
    float* a = acc + h * DIM;
    const float *ph = p + h * TILE, *ch = corr + h;
    switch (std::min<int64_t>(8, group - h)) {
      case 1: heads_pv<DIM, 1>(a, ph, ch, v, row_len, n, h == 0 ? pf : nullptr, h == 0 ? far : nullptr, vscale); break;
      case 2: heads_pv<DIM, 2>(a, ph, ch, v, row_len, n, h == 0 ? pf : nullptr, h == 0 ? far : nullptr, vscale); break;
      case 3: heads_pv<DIM, 3>(a, ph, ch, v, row_len, n, h == 0 ? pf : nullptr, h == 0 ? far : nullptr, vscale); break;
      case 4: heads_pv<DIM, 4>(a, ph, ch, v, row_len, n, h == 0 ? pf : nullptr, h == 0 ? far : nullptr, vscale); break;
      case 5: heads_pv<DIM, 5>(a, ph, ch, v, row_len, n, h == 0 ? pf : nullptr, h == 0 ? far : nullptr, vscale); break;
      case 6: heads_pv<DIM, 6>(a, ph, ch, v, row_len, n, h == 0 ? pf : nullptr, h == 0 ? far : nullptr, vscale); break;
      case 7: heads_pv<DIM, 7>(a, ph, ch, v, row_len, n, h == 0 ? pf : nullptr, h == 0 ? far : nullptr, vscale); break;
      default: heads_pv<DIM, 8>(a, ph, ch, v, row_len, n, h == 0 ? pf : nullptr, h == 0 ? far : nullptr, vscale); break;
    }
  }
}

// out = acc / l as bf16, each chunk's columns put back in order from tile_pv's layout: its two halves' groups
// of four columns (L = 0..3) alternate, low half's first
template <int64_t DIM>
void store_heads(const float* acc, const float* l, int64_t hq, at::BFloat16* out) {
  const __m512i order = _mm512_setr_epi64(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t h = 0; h < hq; ++h) {
    const __m512 inv = _mm512_set1_ps(l[h] > 0.f ? 1.f / l[h] : 0.f);
    for (int64_t c = 0; c < DIM / 32; ++c) {
      const float* a = acc + h * DIM + c * 32;
      const __m256i lo = (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(inv, _mm512_loadu_ps(a)));
      const __m256i hi = (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(inv, _mm512_loadu_ps(a + 16)));
      const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
      _mm512_storeu_si512(out + h * DIM + c * 32, _mm512_permutexvar_epi64(order, both));
    }
  }
}

// The blocks of sequences [begin, end) in order, for prefetching ahead across sequence ends.
struct BlockCursor {
  const int32_t *tables, *lens;
  int64_t max_blocks, bs, window, end, b, bi;
  int64_t first(int64_t s) const { return window > 0 ? std::max<int64_t>(0, lens[s] - window) / bs : 0; }
  int64_t last(int64_t s) const { return (lens[s] + bs - 1) / bs; }
  void skip_empty() {
    while (b < end && bi >= last(b)) if (++b < end) bi = first(b);
  }
  bool valid() const { return b < end; }
  int64_t block() const { return tables[b * max_blocks + bi]; }
  void next() { ++bi; skip_empty(); }
};

// ks, vs: an fp8 cache's scales [slots, hk] (E = uint8_t); null for a bf16 cache
template <int64_t DIM, typename E>
void decode_dpbf16(const at::BFloat16* q, int64_t q_seq_stride, int64_t q_head_stride, const E* kc, const E* vc,
                   const int32_t* tables, const int32_t* lens, at::BFloat16* out, int64_t num_seqs, int64_t hq,
                   int64_t hk, int64_t bs, int64_t max_blocks, float scale, int64_t window, const float* ks,
                   const float* vs) {
  constexpr bool SCALED = std::is_same_v<E, uint8_t>;
  static_assert(DIM % 32 == 0, "head size must be a multiple of 32");
  constexpr int64_t NV = DIM / 32;
  const int64_t group = hq / hk, row_len = hk * DIM;
  at::parallel_for(0, num_seqs, 1, [&](int64_t begin, int64_t end) {
    std::vector<__m512i> qv(hq * NV * 4);
    std::vector<float> acc(hq * DIM), p(group * TILE), corr(group), m(hq), l(hq);
    std::vector<__m512> lv(hq);
    BlockCursor ahead{tables, lens, max_blocks, bs, window, end, begin, 0};
    ahead.bi = ahead.first(begin);
    ahead.skip_empty();
    constexpr int64_t R = 8;
    int64_t ring[R];  // start offsets of the current block and the next R - 1 (-1: none)
    for (int64_t i = 0; i < R; ++i) {
      ring[i] = ahead.valid() ? ahead.block() * bs * row_len : -1;
      ahead.next();
    }
    constexpr int64_t near_slices = std::max<int64_t>(1, 8192 / (TILE * DIM * 4));
    const int64_t tiles_per_block = std::max<int64_t>(1, bs / TILE);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t len = lens[b];
      const int64_t start = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      for (int64_t h = 0; h < hq; ++h)
        for (int64_t c = 0; c < NV; ++c) {
          const __m512i x = _mm512_loadu_si512(q + b * q_seq_stride + h * q_head_stride + c * 32);
          // lane (L, k) of permuted vector b: pair 4L + b (see heads_scores_load)
          for (int bb = 0; bb < 4; ++bb) {
            const __m512i idx = _mm512_add_epi32(
                _mm512_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12), _mm512_set1_epi32(bb));
            qv[(h * NV + c) * 4 + bb] = _mm512_permutexvar_epi32(idx, x);
          }
        }
      reset(acc, m, l);
      std::fill(lv.begin(), lv.end(), _mm512_setzero_ps());
      for (int64_t bi = start / bs; bi * bs < len; ++bi) {
        const int64_t p0 = std::max(start, bi * bs), rows = std::min(len, (bi + 1) * bs) - p0;
        const int64_t slot0 = tables[b * max_blocks + bi] * bs + (p0 - bi * bs), base = slot0 * row_len;
        for (int64_t t = 0; t < rows; t += TILE) {
          const int64_t n = std::min(TILE, rows - t);
          const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
          for (int64_t kh = 0; kh < hk; ++kh) {
            const int64_t off = base + t * row_len + kh * DIM;
            // the kv-head slice `ahead` slices on (a slice: kv head kh of a tile; blocks hold tiles
            // whole where bs is a multiple of TILE, else prefetches stop at the block's first tile)
            auto slice = [&](int64_t ahead) -> int64_t {
              const int64_t i = kh + ahead, tile = (p0 - bi * bs + t) / TILE + i / hk;
              const int64_t blk = std::min(tile / tiles_per_block, R - 1), in_block = tile % tiles_per_block;
              return ring[blk] >= 0 && (in_block + 1) * TILE <= bs ? ring[blk] + in_block * TILE * row_len + (i % hk) * DIM
                                                                   : -1;
            };
            const int64_t near = slice(near_slices), far = slice(FAR_SLICES);
            const E *kn = near >= 0 ? kc + near : nullptr, *vn = near >= 0 ? vc + near : nullptr;
            const E *kf = far >= 0 ? kc + far : nullptr, *vf = far >= 0 ? vc + far : nullptr;
            // the tile's keys' scales (0 past n, where the scores are masked and the probabilities 0)
            alignas(64) float kscale[TILE], vscale[TILE];
            __m512 score_scale = _mm512_set1_ps(scale);
            if constexpr (SCALED) {
              for (int64_t j = 0; j < TILE; ++j) {
                kscale[j] = j < n ? ks[(slot0 + t + j) * hk + kh] : 0.f;
                vscale[j] = j < n ? vs[(slot0 + t + j) * hk + kh] : 0.f;
              }
              score_scale = _mm512_mul_ps(score_scale, _mm512_load_ps(kscale));
            }
            const __m512i* qd = qv.data() + kh * group * NV * 4;
            if (n == TILE) group_scores<NV, true>(qd, kc + off, row_len, n, group, p.data(), kn, kf, vf);
            else group_scores<NV, false>(qd, kc + off, row_len, n, group, p.data(), kn, kf, vf);
            for (int64_t g = 0; g < group; g += 4) {
              float *pg = p.data() + g * TILE, *mg = m.data() + kh * group + g, *cg = corr.data() + g;
              __m512* lg = lv.data() + kh * group + g;
              switch (std::min<int64_t>(4, group - g)) {
                case 1: heads_softmax<1>(pg, score_scale, valid, mg, lg, cg); break;
                case 2: heads_softmax<2>(pg, score_scale, valid, mg, lg, cg); break;
                case 3: heads_softmax<3>(pg, score_scale, valid, mg, lg, cg); break;
                default: heads_softmax<4>(pg, score_scale, valid, mg, lg, cg); break;
              }
            }
            group_pv<DIM>(acc.data() + kh * group * DIM, p.data(), corr.data(), vc + off, row_len, n, group, vn,
                          static_cast<const E*>(nullptr), SCALED ? vscale : nullptr);
          }
        }
        for (int64_t i = 0; i + 1 < R; ++i) ring[i] = ring[i + 1];
        ring[R - 1] = ahead.valid() ? ahead.block() * bs * row_len : -1;
        ahead.next();
      }
      for (int64_t h = 0; h < hq; ++h) l[h] = _mm512_reduce_add_ps(lv[h]);
      store_heads<DIM>(acc.data(), l.data(), hq, out + b * hq * DIM);
    }
  });
}
#endif


at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                        int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  // q may be a strided view (a split of a fused qkv projection) as long as each head's row is contiguous
  TORCH_CHECK(q.stride(2) == 1 && k_cache.is_contiguous() && v_cache.is_contiguous(), "need contiguous");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type(), "q and cache dtypes differ");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt, "need int32");
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto out = at::empty(q.sizes(), q.options());
  const int64_t hq = q.size(1), dim = q.size(2), bs = k_cache.size(1), hk = k_cache.size(2);
  TORCH_CHECK(hq % hk == 0 && k_cache.size(3) == dim, "head shapes do not match");
  if (q.scalar_type() == at::kBFloat16) {
    tokenmill::paged_decode_bf16(reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>()), q.stride(0),
                                 q.stride(1), reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>()),
                                 reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>()),
                                 tables.data_ptr<int32_t>(), lens.data_ptr<int32_t>(),
                                 reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), q.size(0), hq, hk, dim, bs,
                                 tables.size(1), static_cast<float>(scale), window);
    return out;
  }
  if (q.scalar_type() == at::kFloat) {
    tokenmill::paged_decode_f32(q.data_ptr<float>(), q.stride(0), q.stride(1), k_cache.data_ptr<float>(),
                                v_cache.data_ptr<float>(), tables.data_ptr<int32_t>(), lens.data_ptr<int32_t>(),
                                out.data_ptr<float>(), q.size(0), hq, hk, dim, bs, tables.size(1),
                                static_cast<float>(scale), window);
    return out;
  }
  auto run = [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    decode_any_dim<T>(q.data_ptr<T>(), q.stride(0), q.stride(1), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(), tables.data_ptr<int32_t>(),
              lens.data_ptr<int32_t>(), out.data_ptr<T>(), q.size(0), hq, hk, dim, bs, tables.size(1),
              static_cast<float>(scale), window);
  };
  switch (q.scalar_type()) {
    case at::kHalf: run(static_cast<at::Half*>(nullptr)); break;
    default: TORCH_CHECK(false, "paged_decode: unsupported dtype ", q.scalar_type());
  }
  return out;
}

}  // namespace

void tokenmill::paged_decode_f32(const float* q, int64_t q_seq_stride, int64_t q_head_stride, const float* kc,
                                 const float* vc, const int32_t* tables, const int32_t* lens, float* out, int64_t t,
                                 int64_t hq, int64_t hk, int64_t dim, int64_t bs, int64_t max_blocks, float scale,
                                 int64_t window) {
#if defined(TOKENMILL_F32_AVX2)
  if (dim == 64 || dim == 128) {
    auto fast = dim == 64 ? decode_f32_avx2<64> : decode_f32_avx2<128>;
    fast(q, q_seq_stride, q_head_stride, kc, vc, tables, lens, out, t, hq, hk, bs, max_blocks, scale, window);
    return;
  }
#endif
  decode_any_dim(q, q_seq_stride, q_head_stride, kc, vc, tables, lens, out, t, hq, hk, dim, bs, max_blocks, scale,
                 window);
}

void tokenmill::paged_decode_bf16(const uint16_t* q, int64_t q_seq_stride, int64_t q_head_stride, const uint16_t* kc,
                                  const uint16_t* vc, const int32_t* tables, const int32_t* lens, uint16_t* out,
                                  int64_t t, int64_t hq, int64_t hk, int64_t dim, int64_t bs, int64_t max_blocks,
                                  float scale, int64_t window) {
  using B = at::BFloat16;
  const B* qb = reinterpret_cast<const B*>(q);
  const B* kb = reinterpret_cast<const B*>(kc);
  const B* vb = reinterpret_cast<const B*>(vc);
  B* ob = reinterpret_cast<B*>(out);
#ifdef TOKENMILL_DPBF16
  if (dim == 64 || dim == 128) {
    auto kernel = dim == 64 ? decode_dpbf16<64, B> : decode_dpbf16<128, B>;
    kernel(qb, q_seq_stride, q_head_stride, kb, vb, tables, lens, ob, t, hq, hk, bs, max_blocks, scale, window,
           nullptr, nullptr);
    return;
  }
#endif
  decode_any_dim(qb, q_seq_stride, q_head_stride, kb, vb, tables, lens, ob, t, hq, hk, dim, bs, max_blocks, scale,
                 window);
}

bool tokenmill::paged_decode_fp8_bf16(const uint16_t* q, int64_t q_seq_stride, int64_t q_head_stride,
                                      const uint8_t* kc, const uint8_t* vc, const float* ks, const float* vs,
                                      const int32_t* tables, const int32_t* lens, uint16_t* out, int64_t t, int64_t hq,
                                      int64_t hk, int64_t dim, int64_t bs, int64_t max_blocks, float scale,
                                      int64_t window) {
#ifdef TOKENMILL_DPBF16
  if (dim == 64 || dim == 128) {
    using B = at::BFloat16;
    auto kernel = dim == 64 ? decode_dpbf16<64, uint8_t> : decode_dpbf16<128, uint8_t>;
    kernel(reinterpret_cast<const B*>(q), q_seq_stride, q_head_stride, kc, vc, tables, lens, reinterpret_cast<B*>(out),
           t, hq, hk, bs, max_blocks, scale, window, ks, vs);
    return true;
  }
#endif
  return false;
}

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
        "float scale, int window) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill_cpu, CPU, m) { m.impl("paged_decode", &paged_decode); }
