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

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "common.h"

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

// Visits a sequence's context [start, len) block by block: fn(base, n) gets the element offset of
// the first row (all kv heads of a row are contiguous) and the row count; the next block's K and V
// are prefetched while fn works, since blocks live anywhere in the pool.
template <typename T, typename Fn>
inline void for_each_block(const int32_t* table, const T* kc, const T* vc, int64_t bs, int64_t row_len,
                           int64_t start, int64_t len, Fn&& fn) {
  for (int64_t bi = start / bs; bi * bs < len; ++bi) {
    const int64_t p0 = std::max(start, bi * bs), n = std::min(len, (bi + 1) * bs) - p0;
    if ((bi + 1) * bs < len) {
      const int64_t next = table[bi + 1] * bs * row_len;
      prefetch(kc + next, bs * row_len);
      prefetch(vc + next, bs * row_len);
    }
    fn((table[bi] * bs + (p0 - bi * bs)) * row_len, n);
  }
}

inline void reset(std::vector<float>& acc, std::vector<float>& m, std::vector<float>& l) {
  std::fill(acc.begin(), acc.end(), 0.f);
  std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
  std::fill(l.begin(), l.end(), 0.f);
}

// Online softmax over one block: folds the block's raw scores s[h * bs + j] (j < n) into each
// head's running max m and sum l, rescales its accumulator acc[h * dim ...], and leaves the
// block's unnormalised probabilities in s.
inline void softmax_block(float* s, int64_t bs, int64_t n, int64_t hq, int64_t dim, float* m, float* l,
                          float* acc) {
  for (int64_t h = 0; h < hq; ++h) {
    float* sh = s + h * bs;
    float bmax = m[h];
    for (int64_t j = 0; j < n; ++j) bmax = std::max(bmax, sh[j]);
    const float corr = tokenmill::exp_approx(m[h] - bmax);
    m[h] = bmax;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < n; ++j) {
      sh[j] = tokenmill::exp_approx(sh[j] - bmax);
      sum += sh[j];
    }
    l[h] = l[h] * corr + sum;
    float* a = acc + h * dim;
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) a[d] *= corr;
  }
}

inline void normalize(float* acc, const float* l, int64_t hq, int64_t dim) {
  for (int64_t h = 0; h < hq; ++h) {
    const float inv = l[h] > 0.f ? 1.f / l[h] : 0.f;
    for (int64_t d = 0; d < dim; ++d) acc[h * dim + d] *= inv;
  }
}

template <typename T, int64_t DIM>
void decode(const T* q, const T* kc, const T* vc, const int32_t* tables, const int32_t* lens, T* out,
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
      load_row(q + b * hq * dim, qf.data(), hq * dim);
      for (int64_t i = 0; i < hq * dim; ++i) qf[i] *= scale;
      reset(acc, m, l);
      for_each_block(tables + b * max_blocks, kc, vc, bs, row_len, start, len, [&](int64_t base, int64_t n) {
        for (int64_t j = 0; j < n; ++j) {
          load_row(kc + base + j * row_len, row.data(), row_len);
          for (int64_t kh = 0, h = 0; kh < hk; ++kh)
            for (int64_t g = 0; g < group; ++g, ++h)
              s[h * bs + j] = dot<DIM>(qf.data() + h * dim, row.data() + kh * dim, dim);
        }
        softmax_block(s.data(), bs, n, hq, dim, m.data(), l.data(), acc.data());
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


#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define TOKENMILL_DPBF16 1
// bf16 caches on CPUs with AVX512-BF16: q.k by vdpbf16ps straight from the cached bf16 (no
// conversion of K), the score scaled afterwards; V rows widened once and accumulated for all
// heads. Same traversal and online softmax as decode() above.
template <int64_t DIM>
void decode_dpbf16(const at::BFloat16* q, const at::BFloat16* kc, const at::BFloat16* vc, const int32_t* tables,
                   const int32_t* lens, at::BFloat16* out, int64_t num_seqs, int64_t hq, int64_t hk, int64_t bs,
                   int64_t max_blocks, float scale, int64_t window) {
  static_assert(DIM % 32 == 0, "head size must be a multiple of 32");
  constexpr int64_t NV = DIM / 32, NF = DIM / 16;
  const int64_t group = hq / hk, row_len = hk * DIM;
  at::parallel_for(0, num_seqs, 1, [&](int64_t begin, int64_t end) {
    std::vector<__m512i> qv(hq * NV);
    std::vector<float> acc(hq * DIM), s(hq * bs), m(hq), l(hq);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t len = lens[b];
      const int64_t start = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const auto* qb = reinterpret_cast<const __m512i*>(q + b * hq * DIM);
      for (int64_t i = 0; i < hq * NV; ++i) qv[i] = _mm512_loadu_si512(qb + i);
      reset(acc, m, l);
      for_each_block(tables + b * max_blocks, kc, vc, bs, row_len, start, len, [&](int64_t base, int64_t n) {
        for (int64_t j = 0; j < n; ++j) {
          const auto* krow = reinterpret_cast<const __m512i*>(kc + base + j * row_len);
          for (int64_t kh = 0, h = 0; kh < hk; ++kh) {
            __m512i kv[NV];
            for (int64_t c = 0; c < NV; ++c) kv[c] = _mm512_loadu_si512(krow + kh * NV + c);
            for (int64_t g = 0; g < group; ++g, ++h) {
              __m512 a = _mm512_setzero_ps();
              for (int64_t c = 0; c < NV; ++c)
                a = _mm512_dpbf16_ps(a, (__m512bh)qv[h * NV + c], (__m512bh)kv[c]);
              s[h * bs + j] = _mm512_reduce_add_ps(a) * scale;
            }
          }
        }
        softmax_block(s.data(), bs, n, hq, DIM, m.data(), l.data(), acc.data());
        for (int64_t j = 0; j < n; ++j) {
          const auto* vrow = reinterpret_cast<const __m256i*>(vc + base + j * row_len);
          for (int64_t kh = 0, h0 = 0; kh < hk; ++kh, h0 += group) {
            for (int64_t f = 0; f < NF; ++f) {
              const __m512 v = _mm512_castsi512_ps(
                  _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(vrow + kh * NF + f)), 16));
              for (int64_t g = 0; g < group; ++g) {
                float* a = acc.data() + (h0 + g) * DIM + f * 16;
                _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_set1_ps(s[(h0 + g) * bs + j]), v, _mm512_loadu_ps(a)));
              }
            }
          }
        }
      });
      normalize(acc.data(), l.data(), hq, DIM);
      store_row(acc.data(), out + b * hq * DIM, hq * DIM);
    }
  });
}
#endif

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                        int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "need contiguous");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type(), "q and cache dtypes differ");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt, "need int32");
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto out = at::empty_like(q);
  const int64_t hq = q.size(1), dim = q.size(2), bs = k_cache.size(1), hk = k_cache.size(2);
  TORCH_CHECK(hq % hk == 0 && k_cache.size(3) == dim, "head shapes do not match");
#ifdef TOKENMILL_DPBF16
  if (q.scalar_type() == at::kBFloat16 && (dim == 64 || dim == 128)) {
    auto kernel = dim == 64 ? decode_dpbf16<64> : decode_dpbf16<128>;
    kernel(q.data_ptr<at::BFloat16>(), k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>(),
           tables.data_ptr<int32_t>(), lens.data_ptr<int32_t>(), out.data_ptr<at::BFloat16>(), q.size(0), hq, hk,
           bs, tables.size(1), static_cast<float>(scale), window);
    return out;
  }
#endif
  auto run = [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    auto kernel = dim == 64 ? decode<T, 64> : dim == 128 ? decode<T, 128> : decode<T, 0>;
    kernel(q.data_ptr<T>(), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(), tables.data_ptr<int32_t>(),
              lens.data_ptr<int32_t>(), out.data_ptr<T>(), q.size(0), hq, hk, dim, bs, tables.size(1),
              static_cast<float>(scale), window);
  };
  switch (q.scalar_type()) {
    case at::kFloat: run(static_cast<float*>(nullptr)); break;
    case at::kBFloat16: run(static_cast<at::BFloat16*>(nullptr)); break;
    case at::kHalf: run(static_cast<at::Half*>(nullptr)); break;
    default: TORCH_CHECK(false, "paged_decode: unsupported dtype ", q.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
        "float scale, int window) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill_cpu, CPU, m) { m.impl("paged_decode", &paged_decode); }
