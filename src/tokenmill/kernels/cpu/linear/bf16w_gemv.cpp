// float32 rows times a bf16 weight kept as the checkpoint stores it ([N, K], row-major), for CPUs with AVX2
// and FMA but no bf16 arithmetic (tokenmill.layers.linear's bf16-stored weights): y [M, N] = x [M, K] W^T
// (+ bias), float32. Each bf16 weight widens exactly to float32 (a 16-bit shift), so the products are the
// float32 model's up to summation order. At decode sizes the work is reading the weight, and this reads half
// the bytes of a float32 copy; it takes up to kMaxRows rows, 8 at a time against each weight row.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <algorithm>
#include <cstring>

#include "kernels.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "avx2.h"
#include "common.h"

namespace {

constexpr int64_t kMaxRows = 64;
// the most rows the layers give it (and the fused decode call takes): past it bf16w_gemm runs the layers' rows,
// which overtakes this kernel between 16 and 64 rows by shape (bench/README.md)
constexpr int64_t kLayerRows = 16;

using tokenmill::bf16_bits_to_f32;
using tokenmill::hsum8;
using tokenmill::widen8_bf16;
using tokenmill::with_rows;


// how far ahead of the loads the weight stream is prefetched, in bf16 elements (1 KiB): from DRAM, one thread
// reads the weights at ~1.3x the rate without it (bench/README.md)
constexpr int64_t kPrefetch = 512;

inline void prefetch(const uint16_t* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0); }

// one output feature n for all M rows: the weight row read once, two accumulators a row
template <int M>
void row(const float* x, int64_t ldx, const uint16_t* w, int64_t K, float* out) {
  __m256 a0[M], a1[M];
  for (int m = 0; m < M; ++m) a0[m] = a1[m] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    if ((k & 31) == 0) prefetch(w + k + kPrefetch);  // (a prefetch past the weight's end is harmless)
    const __m256 w0 = widen8_bf16(w + k), w1 = widen8_bf16(w + k + 8);
    for (int m = 0; m < M; ++m) {
      a0[m] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + m * ldx + k), a0[m]);
      a1[m] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + m * ldx + k + 8), a1[m]);
    }
  }
  for (; k + 8 <= K; k += 8) {
    const __m256 w0 = widen8_bf16(w + k);
    for (int m = 0; m < M; ++m) a0[m] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + m * ldx + k), a0[m]);
  }
  for (int m = 0; m < M; ++m) {
    float s = hsum8(_mm256_add_ps(a0[m], a1[m]));
    for (int64_t j = k; j < K; ++j) s += bf16_bits_to_f32(w[j]) * x[m * ldx + j];
    out[m] = s;
  }
}

// one row of x: four accumulators, so that the FMAs' latency does not bound the weight stream
template <>
void row<1>(const float* x, int64_t, const uint16_t* w, int64_t K, float* out) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    prefetch(w + k + kPrefetch);
    a0 = _mm256_fmadd_ps(widen8_bf16(w + k), _mm256_loadu_ps(x + k), a0);
    a1 = _mm256_fmadd_ps(widen8_bf16(w + k + 8), _mm256_loadu_ps(x + k + 8), a1);
    a2 = _mm256_fmadd_ps(widen8_bf16(w + k + 16), _mm256_loadu_ps(x + k + 16), a2);
    a3 = _mm256_fmadd_ps(widen8_bf16(w + k + 24), _mm256_loadu_ps(x + k + 24), a3);
  }
  for (; k + 8 <= K; k += 8) a0 = _mm256_fmadd_ps(widen8_bf16(w + k), _mm256_loadu_ps(x + k), a0);
  float s = hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  for (; k < K; ++k) s += bf16_bits_to_f32(w[k]) * x[k];
  out[0] = s;
}

// the most rows of x taken against a pair of weight rows at once: 2 * 6 accumulators, the pair's two slices and
// one slice of x fill the 16 ymm registers
constexpr int64_t kPairRows = 6;

// M rows of x against two weight rows, w and w + K: each slice of x loaded once feeds both, so that more
// than one row of x is bound by the FMAs rather than by the loads. out[m] for w, out[M + m] for w + K.
template <int M>
void row_pair(const float* x, int64_t ldx, const uint16_t* w, int64_t K, float* out) {
  const uint16_t* v = w + K;
  __m256 a[M], b[M];
  for (int m = 0; m < M; ++m) a[m] = b[m] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    if ((k & 31) == 0) {
      prefetch(w + k + kPrefetch);
      prefetch(v + k + kPrefetch);
    }
    const __m256 w0 = widen8_bf16(w + k), w1 = widen8_bf16(v + k);
    for (int m = 0; m < M; ++m) {
      const __m256 xm = _mm256_loadu_ps(x + m * ldx + k);
      a[m] = _mm256_fmadd_ps(w0, xm, a[m]);
      b[m] = _mm256_fmadd_ps(w1, xm, b[m]);
    }
  }
  for (int m = 0; m < M; ++m) {
    float s = hsum8(a[m]), t = hsum8(b[m]);
    for (int64_t j = k; j < K; ++j) {
      s += bf16_bits_to_f32(w[j]) * x[m * ldx + j];
      t += bf16_bits_to_f32(v[j]) * x[m * ldx + j];
    }
    out[m] = s;
    out[M + m] = t;
  }
}

// m (2 <= m <= kPairRows) rows of x against weight rows w and w + K
inline void pair_chunk(const float* x, int64_t ldx, const uint16_t* w, int64_t K, int64_t m, float* out) {
  with_rows<2, kPairRows>(m, [&](auto rows) { row_pair<decltype(rows)::value>(x, ldx, w, K, out); });
}

// rows m0 .. m0 + m of x against weight row w (m <= 8)
inline void rows_chunk(const float* x, int64_t ldx, const uint16_t* w, int64_t K, int64_t m, float* out) {
  with_rows<1, 8>(m, [&](auto rows) { row<decltype(rows)::value>(x, ldx, w, K, out); });
}

at::Tensor bf16w_gemv(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, "bf16w_gemv: x must be float32 [M, K]");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.is_contiguous() &&
                  weight.size(1) == x.size(1), "bf16w_gemv: weight must be contiguous bf16 [N, K]");
  const int64_t M = x.size(0), N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(M <= kMaxRows, "bf16w_gemv: at most ", kMaxRows, " rows, got ", M);
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.numel() == N, "bf16w_gemv: bias must have N elements");
  }
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const auto* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  if (M == 0) return y;
  // each weight row is read from memory once; over more rows of x than one pass takes, the passes after the
  // first find it in L1. More than 8 rows of x take the weight rows in pairs, the rows of x in as few chunks of
  // at most kPairRows as cover them, evenly sized; up to 8, one weight row at a time, which reads from memory at
  // a higher rate there (two streams a pair did not, bench/README.md).
  const int64_t chunks = (M + kPairRows - 1) / kPairRows;
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    float out[2 * kPairRows];
    int64_t n = n0;
    for (; M > 8 && n + 2 <= n1; n += 2) {
      for (int64_t c = 0, m0 = 0; c < chunks; ++c) {
        const int64_t m = M / chunks + (c < M % chunks ? 1 : 0);
        pair_chunk(xp + m0 * ldx, ldx, wp + n * K, K, m, out);
        for (int64_t i = 0; i < m; ++i) {
          yp[(m0 + i) * N + n] = out[i] + (bp ? bp[n] : 0.0f);
          yp[(m0 + i) * N + n + 1] = out[m + i] + (bp ? bp[n + 1] : 0.0f);
        }
        m0 += m;
      }
    }
    for (; n < n1; ++n) {
      for (int64_t m0 = 0; m0 < M; m0 += 8) {
        const int64_t m = std::min<int64_t>(8, M - m0);
        rows_chunk(xp + m0 * ldx, ldx, wp + n * K, K, m, out);
        for (int64_t i = 0; i < m; ++i) yp[(m0 + i) * N + n] = out[i] + (bp ? bp[n] : 0.0f);
      }
    }
  });
  return y;
}

}  // namespace

int64_t tokenmill::bf16w_gemv_max_rows() { return kLayerRows; }

#else  // no AVX2/FMA: the layers keep their torch path (bf16w_gemv_max_rows() == 0)

int64_t tokenmill::bf16w_gemv_max_rows() { return 0; }

namespace {
at::Tensor bf16w_gemv(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&) {
  TORCH_CHECK(false, "bf16w_gemv: built without AVX2/FMA");
}
}  // namespace

#endif

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def("bf16w_gemv_max_rows() -> int", &tokenmill::bf16w_gemv_max_rows);
  m.def("bf16w_gemv(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
}
TORCH_LIBRARY_IMPL(tokenmill_cpu, CPU, m) { m.impl("bf16w_gemv", &bf16w_gemv); }
