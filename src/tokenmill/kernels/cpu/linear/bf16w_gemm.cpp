// float32 rows times a bf16 weight kept as the checkpoint stores it ([N, K], row-major), for any number of rows:
// y [M, N] = x [M, K] W^T (+ bias), float32, on CPUs with AVX2 and FMA but no bf16 arithmetic. It is the
// product of bf16-stored weights past bf16w_gemv's rows (prefill chunks, large decode batches, a routed expert's
// rows): tokenmill.layers.linear calls it where it would otherwise widen the weight to float32 a tile at a time
// for torch's product. Each bf16 weight widens exactly to float32 (a 16-bit shift), so the products are the
// float32 model's up to summation order.
//
// Blocking (the outer-product form of BLIS-style GEMMs): the output columns are split between the threads. For a
// block of kMc rows of x, a thread takes its kNr-column panels of the weight one at a time, and for each kKc of K
// packs the panel's slice, widened and transposed to [k][kNr] (the pack is the only place a bf16 weight is read),
// and runs every kMr-row strip of the block against it: the micro-kernel keeps kMr x kNr accumulators (12 AVX2
// registers) and takes one broadcast of x and two panel loads a k, the packed slice (16 KiB) reused from L1 across
// the strips. A panel's outputs (kMc x kNr) stay in cache between K's slices, so a wide output (an lm_head's) is
// not written back and read again for each slice.
//
// bf16p_gemm is the same product over a weight stored once, at load, in the panels' order (bf16): its micro-kernel
// reads each k's 16 weights with one load and widens them in registers, so no slice is gathered or packed.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "avx2.h"
#include "common.h"

namespace {

constexpr int64_t kMr = 6;    // rows of x a micro-kernel takes
constexpr int64_t kNr = 16;   // output columns a micro-kernel (and a packed panel) takes
constexpr int64_t kKc = 256;  // K a block takes: a packed panel is kKc x kNr float32 (16 KiB, in L1)
constexpr int64_t kMc = 192;  // rows of x a block takes: a panel reads the block's kMc x K float32 once
constexpr int64_t kPrefetchK = 32;  // how far ahead (in k: 1 KiB of a bf16 panel) bf16p_gemm prefetches its panel

using tokenmill::bf16_bits_to_f32;
using tokenmill::widen8_bf16;
using tokenmill::with_rows;

// r[i] (row i, 8 floats) -> r[j] = column j
inline void transpose8(__m256 r[8]) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  r[0] = _mm256_permute2f128_ps(s0, s4, 0x20);
  r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
  r[2] = _mm256_permute2f128_ps(s2, s6, 0x20);
  r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
  r[4] = _mm256_permute2f128_ps(s0, s4, 0x31);
  r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
  r[6] = _mm256_permute2f128_ps(s2, s6, 0x31);
  r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

// panel[k * kNr + j] = W[n0 + j, k0 + k] widened, for j < cols (the rest 0) and k < kc
void pack_panel(const uint16_t* w, int64_t K, int64_t n0, int64_t cols, int64_t k0, int64_t kc, float* panel) {
  if (cols == kNr) {
    int64_t k = 0;
    for (; k + 8 <= kc; k += 8) {
      for (int64_t half = 0; half < 2; ++half) {
        __m256 r[8];
        for (int64_t i = 0; i < 8; ++i) r[i] = widen8_bf16(w + (n0 + half * 8 + i) * K + k0 + k);
        transpose8(r);
        for (int64_t i = 0; i < 8; ++i) _mm256_storeu_ps(panel + (k + i) * kNr + half * 8, r[i]);
      }
    }
    for (; k < kc; ++k)
      for (int64_t j = 0; j < kNr; ++j) panel[k * kNr + j] = bf16_bits_to_f32(w[(n0 + j) * K + k0 + k]);
    return;
  }
  for (int64_t k = 0; k < kc; ++k)
    for (int64_t j = 0; j < kNr; ++j) panel[k * kNr + j] = j < cols ? bf16_bits_to_f32(w[(n0 + j) * K + k0 + k]) : 0.0f;
}

// R rows of x (stride ldx, from column k0 of the block) times a panel slice over kc, load(k, b0, b1) giving the
// slice's k-th 16 weights as float32: acc -> out (R x kNr, stride ldo), added to what out holds unless first.
// Inlined into its caller, load too: compiled on its own (as with_rows's lambda leaves it), GCC 12 kept the
// accumulators on the stack, storing each of them every k (bench/README.md).
template <int R, typename Load>
__attribute__((always_inline)) inline void micro_k(const float* x, int64_t ldx, int64_t kc, Load&& load, float* out,
                                                   int64_t ldo, bool first) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < kc; ++k) {
    __m256 b0, b1;
    load(k, b0, b1);
    for (int r = 0; r < R; ++r) {
      const __m256 a = _mm256_broadcast_ss(x + r * ldx + k);
      acc[r][0] = _mm256_fmadd_ps(a, b0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(a, b1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float* o = out + r * ldo;
    if (!first) {
      acc[r][0] = _mm256_add_ps(_mm256_loadu_ps(o), acc[r][0]);
      acc[r][1] = _mm256_add_ps(_mm256_loadu_ps(o + 8), acc[r][1]);
    }
    _mm256_storeu_ps(o, acc[r][0]);
    _mm256_storeu_ps(o + 8, acc[r][1]);
  }
}

// micro_k over a packed float32 panel slice (kc x kNr)
template <int R>
__attribute__((always_inline)) inline void micro(const float* x, int64_t ldx, const float* panel, int64_t kc, float* out,
                                                 int64_t ldo, bool first) {
  micro_k<R>(x, ldx, kc, [panel](int64_t k, __m256& b0, __m256& b1) __attribute__((always_inline)) {
    b0 = _mm256_loadu_ps(panel + k * kNr);
    b1 = _mm256_loadu_ps(panel + k * kNr + 8);
  }, out, ldo, first);
}

void micro_rows(int64_t rows, const float* x, int64_t ldx, const float* panel, int64_t kc, float* out, int64_t ldo,
                bool first) {
  with_rows<1, kMr>(rows, [&](auto r) { micro<decltype(r)::value>(x, ldx, panel, kc, out, ldo, first); });
}

// the 16 bf16 of one k of a weight panel (bf16_panels' layout: 32-bit word i holds column i in its low half and
// column 8 + i in its high half) -> columns 0..7 and 8..15 as float32: a shift and a mask, no lane crossing
__attribute__((always_inline)) inline void widen_panel_k(const uint16_t* p, __m256i mask, __m256& b0, __m256& b1) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  b0 = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  b1 = _mm256_castsi256_ps(_mm256_and_si256(v, mask));
}

// micro_k over a bf16 panel slice (kc x kNr, bf16_panels' layout) widened as it is read, prefetched ahead
template <int R>
__attribute__((always_inline)) inline void micro_bf16(const float* x, int64_t ldx, const uint16_t* panel, int64_t kc,
                                                      float* out, int64_t ldo, bool first) {
  const __m256i mask = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  micro_k<R>(x, ldx, kc, [panel, mask](int64_t k, __m256& b0, __m256& b1) __attribute__((always_inline)) {
    _mm_prefetch(reinterpret_cast<const char*>(panel + (k + kPrefetchK) * kNr), _MM_HINT_T0);
    widen_panel_k(panel + k * kNr, mask, b0, b1);
  }, out, ldo, first);
}

// one row: two k at a time into two pairs of accumulators, so that the FMAs' latency does not bound the weight
// stream (a lone row is bound by reading the weights)
template <>
__attribute__((always_inline)) inline void micro_bf16<1>(const float* x, int64_t, const uint16_t* panel, int64_t kc,
                                                         float* out, int64_t, bool first) {
  const __m256i mask = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, c0 = a0, c1 = a0;
  int64_t k = 0;
  for (; k + 2 <= kc; k += 2) {
    _mm_prefetch(reinterpret_cast<const char*>(panel + (k + kPrefetchK) * kNr), _MM_HINT_T0);
    __m256 b0, b1, d0, d1;
    widen_panel_k(panel + k * kNr, mask, b0, b1);
    widen_panel_k(panel + (k + 1) * kNr, mask, d0, d1);
    const __m256 x0 = _mm256_broadcast_ss(x + k), x1 = _mm256_broadcast_ss(x + k + 1);
    a0 = _mm256_fmadd_ps(x0, b0, a0);
    a1 = _mm256_fmadd_ps(x0, b1, a1);
    c0 = _mm256_fmadd_ps(x1, d0, c0);
    c1 = _mm256_fmadd_ps(x1, d1, c1);
  }
  if (k < kc) {
    __m256 b0, b1;
    widen_panel_k(panel + k * kNr, mask, b0, b1);
    const __m256 x0 = _mm256_broadcast_ss(x + k);
    a0 = _mm256_fmadd_ps(x0, b0, a0);
    a1 = _mm256_fmadd_ps(x0, b1, a1);
  }
  a0 = _mm256_add_ps(a0, c0);
  a1 = _mm256_add_ps(a1, c1);
  if (!first) {
    a0 = _mm256_add_ps(_mm256_loadu_ps(out), a0);
    a1 = _mm256_add_ps(_mm256_loadu_ps(out + 8), a1);
  }
  _mm256_storeu_ps(out, a0);
  _mm256_storeu_ps(out + 8, a1);
}

void micro_bf16_rows(int64_t rows, const float* x, int64_t ldx, const uint16_t* panel, int64_t kc, float* out,
                     int64_t ldo, bool first) {
  with_rows<1, kMr>(rows, [&](auto r) { micro_bf16<decltype(r)::value>(x, ldx, panel, kc, out, ldo, first); });
}

// The blocking both weight layouts share: y [M, N] = x [M, K] W^T (+ bias). For each block of rows, panel and
// K slice, prepare(p, n0, cols, k0, kc, buf) readies the slice (packing it into buf, a kKc x kNr float32 buffer, where
// it packs) and returns strip(rows, x, out, ldo, first), which runs one strip of rows against it.
template <typename Prepare>
void blocked_gemm(int64_t M, int64_t N, int64_t K, const float* xp, int64_t ldx, const float* bp, float* yp,
                  Prepare&& prepare) {
  const int64_t panels = (N + kNr - 1) / kNr;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    alignas(32) float buf[kKc * kNr];
    alignas(32) float edge[kMr * kNr];  // a partial panel's outputs, before they go to y
    for (int64_t m0 = 0; m0 < M; m0 += kMc) {
      const int64_t mc = std::min(kMc, M - m0);
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t n0 = p * kNr, cols = std::min(kNr, N - n0);
        for (int64_t k0 = 0; k0 < K; k0 += kKc) {
          const int64_t kc = std::min(kKc, K - k0);
          const bool first = k0 == 0;
          auto strip = prepare(p, n0, cols, k0, kc, buf);
          for (int64_t i = m0; i < m0 + mc; i += kMr) {
            const int64_t rows = std::min(kMr, m0 + mc - i);
            if (cols == kNr) {
              strip(rows, xp + i * ldx + k0, yp + i * N + n0, N, first);
            } else {  // through a full-width buffer: the panel's columns past N are padding
              for (int64_t r = 0; r < rows && !first; ++r)
                std::copy(yp + (i + r) * N + n0, yp + (i + r) * N + N, edge + r * kNr);
              strip(rows, xp + i * ldx + k0, edge, kNr, first);
              for (int64_t r = 0; r < rows; ++r) std::copy(edge + r * kNr, edge + r * kNr + cols, yp + (i + r) * N + n0);
            }
          }
        }
      }
    }
    for (int64_t m = 0; m < M && (bp || K == 0); ++m) {  // the bias (and a K of 0's zeros)
      for (int64_t n = p0 * kNr; n < std::min(N, p1 * kNr); ++n) {
        float& o = yp[m * N + n];
        o = (K == 0 ? 0.0f : o) + (bp ? bp[n] : 0.0f);
      }
    }
  });
}

// blocked_gemm for an op with N output features: its bias widened to float32 (checked), y allocated, the blocking
// run where there is anything to compute
template <typename Prepare>
at::Tensor blocked_product(const at::Tensor& x, int64_t N, const c10::optional<at::Tensor>& bias, const char* op,
                           Prepare&& prepare) {
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.numel() == N, op, ": bias must have N elements");
  }
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  blocked_gemm(M, N, K, x.data_ptr<float>(), x.stride(0), b.defined() ? b.data_ptr<float>() : nullptr,
               y.data_ptr<float>(), prepare);
  return y;
}

at::Tensor bf16w_gemm(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, "bf16w_gemm: x must be float32 [M, K]");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.is_contiguous() &&
                  weight.size(1) == x.size(1), "bf16w_gemm: weight must be contiguous bf16 [N, K]");
  const int64_t N = weight.size(0), K = weight.size(1), ldx = x.stride(0);
  const auto* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  return blocked_product(x, N, bias, "bf16w_gemm",
                         [&](int64_t, int64_t n0, int64_t cols, int64_t k0, int64_t kc, float* buf) {
                           pack_panel(wp, K, n0, cols, k0, kc, buf);
                           return [=](int64_t rows, const float* xs, float* out, int64_t ldo, bool first) {
                             micro_rows(rows, xs, ldx, buf, kc, out, ldo, first);
                           };
                         });
}

// bf16w_gemm over weights kept in bf16_panels' layout (tokenmill.layers.linear.bf16_panels): panels [N / kNr, K, kNr]
// bf16, panel p holding output columns p * kNr .. + kNr, each k's 16 weights as widen_panel_k reads them. A slice is
// read straight from the panels and widened in registers at each strip: no gather, no transpose, no float32 copy
// (which ran slower at every row count measured, bench/README.md). It is the layers' product for any number of
// rows: one row reads the weights at the widening GEMV's rate or above.
at::Tensor bf16p_gemm(const at::Tensor& x, const at::Tensor& panels, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, "bf16p_gemm: x must be float32 [M, K]");
  TORCH_CHECK(panels.dim() == 3 && panels.scalar_type() == at::kBFloat16 && panels.is_contiguous() &&
                  panels.size(1) == x.size(1) && panels.size(2) == kNr,
              "bf16p_gemm: panels must be contiguous bf16 [N / 16, K, 16]");
  const int64_t N = panels.size(0) * kNr, K = x.size(1), ldx = x.stride(0);
  const auto* pp = reinterpret_cast<const uint16_t*>(panels.data_ptr<at::BFloat16>());
  return blocked_product(x, N, bias, "bf16p_gemm", [&](int64_t p, int64_t, int64_t, int64_t k0, int64_t kc, float*) {
    const uint16_t* slice = pp + (p * K + k0) * kNr;
    return [=](int64_t rows, const float* xs, float* out, int64_t ldo, bool first) {
      micro_bf16_rows(rows, xs, ldx, slice, kc, out, ldo, first);
    };
  });
}

// A bf16 [N, K] weight (N a multiple of kNr, contiguous) rearranged in place into bf16_panels' layout and returned
// as [N / kNr, K, kNr]: panel p takes the same bytes as rows p * kNr .. + kNr, so each panel is copied out (a
// kNr x K block, in L2) and written back interleaved, with no second weight-sized buffer. Eight k at a time: row
// i's and row 8 + i's eight bf16 interleave into eight 32-bit words (one per k), and an 8 x 8 transpose of those
// words gives each k's 16 weights in the panels' order.
at::Tensor bf16_panels_(at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.is_contiguous() &&
                  weight.size(0) % kNr == 0, "bf16_panels_: weight must be contiguous bf16 [N, K], N a multiple of 16");
  const int64_t N = weight.size(0), K = weight.size(1);
  auto* w = reinterpret_cast<uint16_t*>(weight.data_ptr<at::BFloat16>());
  at::parallel_for(0, N / kNr, 1, [&](int64_t p0, int64_t p1) {
    std::vector<uint16_t> block(kNr * K);
    for (int64_t p = p0; p < p1; ++p) {
      uint16_t* panel = w + p * kNr * K;
      std::copy(panel, panel + kNr * K, block.data());
      const uint16_t* rows = block.data();
      int64_t k = 0;
      for (; k + 8 <= K; k += 8) {
        __m256 v[8];
        for (int64_t i = 0; i < 8; ++i) {
          const __m128i lo_row = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows + i * K + k));
          const __m128i hi_row = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows + (8 + i) * K + k));
          v[i] = _mm256_castsi256_ps(_mm256_set_m128i(_mm_unpackhi_epi16(lo_row, hi_row), _mm_unpacklo_epi16(lo_row, hi_row)));
        }
        transpose8(v);  // v[j]: the eight words of k + j
        for (int64_t j = 0; j < 8; ++j) _mm256_storeu_ps(reinterpret_cast<float*>(panel + (k + j) * kNr), v[j]);
      }
      for (; k < K; ++k)
        for (int64_t i = 0; i < 8; ++i) {
          panel[k * kNr + 2 * i] = rows[i * K + k];
          panel[k * kNr + 2 * i + 1] = rows[(8 + i) * K + k];
        }
    }
  });
  return weight.view({N / kNr, K, kNr});
}

}  // namespace

#else  // no AVX2/FMA: the layers keep their torch path

namespace {
at::Tensor bf16w_gemm(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&) {
  TORCH_CHECK(false, "bf16w_gemm: built without AVX2/FMA");
}
at::Tensor bf16p_gemm(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&) {
  TORCH_CHECK(false, "bf16p_gemm: built without AVX2/FMA");
}
at::Tensor bf16_panels_(at::Tensor&) { TORCH_CHECK(false, "bf16_panels_: built without AVX2/FMA"); }
}  // namespace

#endif

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def("bf16w_gemm(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("bf16p_gemm(Tensor x, Tensor panels, Tensor? bias) -> Tensor");
  m.def("bf16_panels_(Tensor(a!) weight) -> Tensor(a!)");
}
TORCH_LIBRARY_IMPL(tokenmill_cpu, CPU, m) {
  m.impl("bf16w_gemm", &bf16w_gemm);
  m.impl("bf16p_gemm", &bf16p_gemm);
  m.impl("bf16_panels_", &bf16_panels_);
}
