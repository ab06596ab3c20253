// Quantized linear layers that dequantize in registers: no float copy of the weight is made.
// x [M, K] (bf16 or fp32) is converted once to fp32 (zero-padded in K); accumulation is fp32 (W8A16,
// W4A16) or exact int32 (W8A8); bias is added in fp32 and the output has x's dtype.
//
// Layouts (made by tokenmill.layers.quantization from every checkpoint format):
// - int8_linear: weight int8 [N, K], scale fp32 [N]: y = (x . w_n) * scale_n.
// - int4_linear: weight uint8 [N, Kp/2] (Kp = K padded to 32): within each run of 32 k, byte j holds
//   k = j in its low nibble and k = j + 16 in its high nibble, so one 16-byte load gives two runs of
//   16 consecutive k. scale and zero fp32 [N, ceil(K / group)] (zero empty: 8 throughout, the symmetric
//   case, which then reads no zero points): w = (q - zero) * scale; group is a
//   multiple of 32 (or covers all of K).
// - w8a8_linear: weight int8 [N, Kp] (Kp = K padded to 64, with zeros), scale fp32 [N], wsum int32 [N]
//   (the row sums of the weight). Each row of x is quantized to int8 with its own scale
//   (amax / 127, round half to even) and offset by 128 to unsigned for VNNI's u8 x s8 dot products;
//   the offset comes back off as 128 * wsum.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <tuple>
#include <vector>

#include "kernels.h"

// Built for AVX-512 BW/VNNI: every op. Built for AVX2 + FMA: int8_linear and int4_linear (x, bf16 or fp32, as
// 16-bit fixed point per row against the weights widened to int16); W8A8 and the bf16 limb kernels need VNNI.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define TM_QUANT_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define TM_QUANT_AVX2 1
#endif

namespace {
int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }
constexpr int64_t kVectorMaxRows = 16;  // the most rows the limb kernels take: the layer's KERNEL_MAX_ROWS
}  // namespace

#if defined(TM_QUANT_AVX512) || defined(TM_QUANT_AVX2)
#include <immintrin.h>

#include "avx2.h"
#include "avx512.h"

namespace {

constexpr int64_t kRowTile = 4;  // rows of x sharing one pass over the weight


// x as fp32 [M, Kp], zero beyond K
at::Tensor padded_fp32(const at::Tensor& x, int64_t Kp) {
  const int64_t M = x.size(0), K = x.size(1);
  auto xf = at::zeros({M, Kp}, x.options().dtype(at::kFloat));
  xf.narrow(1, 0, K).copy_(x);
  return xf;
}

void check_x(const at::Tensor& x, int64_t K, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, op, ": x must be [M, ", K, "]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, op, ": x must be bf16 or fp32");
}

at::Tensor finish(at::Tensor y, const c10::optional<at::Tensor>& bias, const at::Tensor& x) {
  if (bias.has_value() && bias->defined()) y.add_(bias->to(at::kFloat));
  return y.scalar_type() == x.scalar_type() ? y : y.to(x.scalar_type());
}

#ifdef TM_QUANT_AVX512

template <int MR>
void int8_rows(const float* x, int64_t ldx, const int8_t* w, const float* scale, int64_t K, int64_t n0,
               int64_t n1, float* y, int64_t ldy) {
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* wn = w + n * K;
    __m512 acc[MR];
    for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
      __m512 wv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wn + k))));
      for (int r = 0; r < MR; ++r) acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(x + r * ldx + k), wv, acc[r]);
    }
    if (k < K) {
      __mmask16 m = static_cast<__mmask16>((1u << (K - k)) - 1);
      __m512 wv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, wn + k)));
      for (int r = 0; r < MR; ++r) acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(x + r * ldx + k), wv, acc[r]);
    }
    for (int r = 0; r < MR; ++r) y[r * ldy + n] = _mm512_reduce_add_ps(acc[r]) * scale[n];
  }
}

// xsum [MR][G]: each row's sum of x over each group, so the zero point comes off once per group
// ((q - zero) . x = q . x - zero * sum(x)) instead of once per weight
template <int MR>
void int4_rows(const float* x, int64_t ldx, const float* xsum, const uint8_t* w, const float* scale,
               const float* zero, int64_t K, int64_t group, int64_t n0, int64_t n1, float* y, int64_t ldy) {
  const int64_t Kp = round_up(K, 32), G = (K + group - 1) / group;
  const __m512i low = _mm512_set1_epi32(0xF);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wn = w + n * (Kp / 2);
    __m512 acc[MR];
    float corr[MR];
    for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps(), corr[r] = 0.0f;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t k_end = std::min(Kp, (g + 1) * group);
      __m512 gacc[MR];
      for (int r = 0; r < MR; ++r) gacc[r] = _mm512_setzero_ps();
      for (int64_t k = g * group; k < k_end; k += 32) {
        __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wn + k / 2)));
        __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(q, low));
        __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4));
        for (int r = 0; r < MR; ++r) {
          gacc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(x + r * ldx + k), lo, gacc[r]);
          gacc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(x + r * ldx + k + 16), hi, gacc[r]);
        }
      }
      const float s = scale[n * G + g], sz = s * (zero ? zero[n * G + g] : 8.0f);
      const __m512 sv = _mm512_set1_ps(s);
      for (int r = 0; r < MR; ++r) {
        acc[r] = _mm512_fmadd_ps(gacc[r], sv, acc[r]);
        corr[r] += sz * xsum[r * G + g];
      }
    }
    for (int r = 0; r < MR; ++r) y[r * ldy + n] = _mm512_reduce_add_ps(acc[r]) - corr[r];
  }
}

template <int MR>
void w8a8_rows(const uint8_t* x, int64_t Kp, const int8_t* w, const float* xs, const float* scale,
               const int32_t* wsum, int64_t n0, int64_t n1, float* y, int64_t ldy) {
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* wn = w + n * Kp;
    __m512i acc[MR];
    for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_si512();
    for (int64_t k = 0; k < Kp; k += 64) {
      __m512i wv = _mm512_loadu_si512(wn + k);
      for (int r = 0; r < MR; ++r) acc[r] = _mm512_dpbusd_epi32(acc[r], _mm512_loadu_si512(x + r * Kp + k), wv);
    }
    for (int r = 0; r < MR; ++r) {
      const int32_t dot = _mm512_reduce_add_epi32(acc[r]) - 128 * wsum[n];
      y[r * ldy + n] = static_cast<float>(dot) * (xs[r] * scale[n]);
    }
  }
}

// One row of x against weights read as runs of memory, where stream_rows(): on AMD's AVX-512 cores (Zen 4)
// reading NR adjacent rows side by side, with the next rows' lines prefetched into L1, streamed the weight at
// 0.5-0.75 of a plain read, and one row after another at about a plain read's rate (bench/README.md, 'Measurements
// behind the code'); int8_stream_rows and int4_stream_rows_g128 read the weight's two halves, each row after row,
// at once. int8 leaves the streams to the hardware prefetcher; int4, with twice the instructions per byte,
// prefetches the line kStreamAhead bytes on into L2 with each line it reads (without it the 1.1B's int4 step took
// 1.2x as long). Elsewhere (Intel's) the NR-row kernels keep the rows they were measured with.
// TOKENMILL_QUANT_ROWS=stream or =blocks, read once, takes one form on any CPU (both give the same outputs; the
// tests run each).
constexpr int64_t kStreamAhead = 16384;
bool stream_rows() {
  static const bool stream = [] {
    const char* order = std::getenv("TOKENMILL_QUANT_ROWS");
    if (order != nullptr && std::strcmp(order, "stream") == 0) return true;
    if (order != nullptr && std::strcmp(order, "blocks") == 0) return false;
    return __builtin_cpu_is("amd") != 0;
  }();
  return stream;
}

// ---- bf16 activations at batch <= KERNEL_MAX_ROWS: int8 dot products (VNNI) over two int8 limbs ----
//
// Converting every weight to float costs more instructions per byte than one core can stream from
// memory, so for bf16 x the W8A16/W4A16 products run on VNNI's u8 x s8 dot products instead: each
// row of x becomes 16-bit fixed point, x ~ s * (256 h + l) with s = amax / 32639 and h, l in
// [-128, 127] (|256 h + l| <= 32639, rounded half to even), which is within amax * 2^-16 of x, finer
// than x's own bf16 rounding of its largest elements; the products of h and l with the integer
// weights are exact in int32 and are scaled in fp32 (per row for int8, per group for int4).

// x's row (bf16) as fp32, 16 values from k (zero past K)
inline __m512 load_bf16(const uint16_t* x, int64_t k, int64_t K) {
  const int64_t left = K - k;
  const __mmask16 m = tokenmill::first_lanes(left);
  const __m256i v = _mm256_maskz_loadu_epi16(m, x + k);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

// One row of x (bf16, K values) as limbs h and l, 16 bytes per 16 k at byte offset dest(k / 16), plus
// (int4 order) each group's sum of 256 h + l. offset: the limbs stored as u8 (+128) for s8 weights.
// Returns s.
template <typename Dest>
float split_row(const uint16_t* x, int64_t K, int64_t Kp, bool offset, Dest dest, int8_t* h, int8_t* l,
                int64_t group, float* gsum) {
  __m512 amax = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(load_bf16(x, k, K)));
  const float s = std::max(_mm512_reduce_max_ps(amax), 1e-30f) / 32639.0f;
  const __m512 inv = _mm512_set1_ps(1.0f / s);
  const __m512i lim = _mm512_set1_epi32(32639), c128 = _mm512_set1_epi32(128), c255 = _mm512_set1_epi32(255);
  const __m512i off = _mm512_set1_epi32(offset ? 128 : 0);
  for (int64_t k = 0; k < Kp; k += 16) {
    __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(k < K ? load_bf16(x, k, K) : _mm512_setzero_ps(), inv));
    v = _mm512_min_epi32(_mm512_max_epi32(v, _mm512_sub_epi32(_mm512_setzero_si512(), lim)), lim);
    const __m512i lo = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(v, c128), c255), c128);
    const __m512i hi = _mm512_srai_epi32(_mm512_sub_epi32(v, lo), 8);
    const int64_t d = dest(k);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(h + d), _mm512_cvtepi32_epi8(_mm512_add_epi32(hi, off)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(l + d), _mm512_cvtepi32_epi8(_mm512_add_epi32(lo, off)));
    if (gsum != nullptr) gsum[k / group] += static_cast<float>(_mm512_reduce_add_epi32(v));
  }
  return s;
}

// int8 weights [N, K] (s8) against limbs stored u8 (+128) [MR][Kp]; the +128 comes off as 128 * wsum.
// NR output rows at a time, so 2 * MR * NR dot-product chains are in flight.
template <int MR, int NR>
void int8_limb_rows(const uint8_t* xh, const uint8_t* xl, int64_t Kp, const float* xs, const int8_t* w,
                    const float* scale, const int32_t* wsum, int64_t K, int64_t n, float* y, int64_t ldy) {
  __m512i ah[MR][NR], al[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) ah[r][j] = _mm512_setzero_si512(), al[r][j] = _mm512_setzero_si512();
  for (int64_t k = 0; k < K; k += 64) {
    const __mmask64 m = K - k >= 64 ? ~__mmask64{0} : (__mmask64{1} << (K - k)) - 1;
    __m512i wv[NR];
    for (int j = 0; j < NR; ++j) {
      // the next NR rows, at the same k: rows of a few KiB end before the hardware prefetchers run ahead
      // (bench/README.md, 'Measurements behind the code')
      _mm_prefetch(reinterpret_cast<const char*>(w + (n + j + NR) * K + k), _MM_HINT_T0);
      wv[j] = _mm512_maskz_loadu_epi8(m, w + (n + j) * K + k);
    }
    for (int r = 0; r < MR; ++r) {
      const __m512i h = _mm512_loadu_si512(xh + r * Kp + k), l = _mm512_loadu_si512(xl + r * Kp + k);
      for (int j = 0; j < NR; ++j) {
        ah[r][j] = _mm512_dpbusd_epi32(ah[r][j], h, wv[j]);
        al[r][j] = _mm512_dpbusd_epi32(al[r][j], l, wv[j]);
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) {
      const int32_t c = 128 * wsum[n + j];
      const double dh = _mm512_reduce_add_epi32(ah[r][j]) - c, dl = _mm512_reduce_add_epi32(al[r][j]) - c;
      y[r * ldy + n + j] = static_cast<float>((256.0 * dh + dl) * (static_cast<double>(xs[r]) * scale[n + j]));
    }
}

// rows(a, b) over output rows n0..n1 as the stream kernels take them: a and a + half together, so that each half of
// the weight is read as one run, two runs at once; an odd count's last row alone (b = -1). Inlined into each
// kernel, so that the rows' loop keeps the kernel's values in registers.
template <typename Rows>
__attribute__((always_inline)) inline void row_pairs(int64_t n0, int64_t n1, Rows rows) {
  const int64_t half = (n1 - n0) / 2;
  for (int64_t i = 0; i < half; ++i) rows(n0 + i, n0 + half + i);
  if ((n1 - n0) % 2) rows(n1 - 1, int64_t{-1});
}

// One row of x against int8 weight rows n0..n1 (stream_rows()), the sums int8_limb_rows<1, 1> makes, with rows a
// and a + half taken together: each half of the weight is read as the one run of memory it is, two streams at
// once left to the hardware prefetcher, and x's limbs are loaded once for two weight rows. A 1.1B model's int8
// projections took 1.08-1.13x as long with one row after another in one chain per limb, and 1.02-1.08x as long
// with four chains per limb (bench/README.md, 'Measurements behind the code'). The sums are the same integers in
// any order, so the outputs are too.
void int8_stream_rows(const uint8_t* xh, const uint8_t* xl, const float* xs, const int8_t* w, const float* scale,
                      const int32_t* wsum, int64_t K, int64_t n0, int64_t n1, float* y) {
  row_pairs(n0, n1, [&](int64_t a, int64_t b) {
    const int8_t *wa = w + a * K, *wb = w + (b >= 0 ? b : a) * K;
    __m512i ah = _mm512_setzero_si512(), al = ah, bh = ah, bl = ah;
    // 64 k at a time, the last (K's remainder) masked
    auto step = [&](int64_t k, __mmask64 m) {
      const __m512i h = _mm512_loadu_si512(xh + k), l = _mm512_loadu_si512(xl + k);
      const __m512i va = _mm512_maskz_loadu_epi8(m, wa + k);
      ah = _mm512_dpbusd_epi32(ah, h, va), al = _mm512_dpbusd_epi32(al, l, va);
      if (b >= 0) {
        const __m512i vb = _mm512_maskz_loadu_epi8(m, wb + k);
        bh = _mm512_dpbusd_epi32(bh, h, vb), bl = _mm512_dpbusd_epi32(bl, l, vb);
      }
    };
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) step(k, ~__mmask64{0});
    if (k < K) step(k, (__mmask64{1} << (K - k)) - 1);
    auto store = [&](int64_t n, __m512i sh, __m512i sl) {
      const int32_t c = 128 * wsum[n];
      const double dh = _mm512_reduce_add_epi32(sh) - c, dl = _mm512_reduce_add_epi32(sl) - c;
      y[n] = static_cast<float>((256.0 * dh + dl) * (static_cast<double>(xs[0]) * scale[n]));
    };
    store(a, ah, al);
    if (b >= 0) store(b, bh, bl);
  });
}

// the 64 bytes at p as their low nibbles and their high ones, each in its byte's low 4 bits
inline void nibbles(const uint8_t* p, __m512i& lo, __m512i& hi) {
  const __m512i v = _mm512_loadu_si512(p), nib = _mm512_set1_epi8(0x0F);
  lo = _mm512_and_si512(v, nib);
#ifdef __GFNI__
  // GF(2) bit matrix moving each byte's bits 4-7 to bits 0-3 (result bit i = parity(row 7 - i & byte))
  hi = _mm512_gf2p8affine_epi64_epi8(v, _mm512_set1_epi64(0x1020408000000000LL), 0);
#else
  hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
#endif
}

// int4 weights (the packed layout, K a multiple of 128 and of nothing smaller than the group's 128)
// against limbs s8 in the packed order: per 128 k, 64 bytes matching the low nibbles, then 64 matching
// the high ones. Zero points (zero non-null): xg [MR][G], each row's per-group sums of 256 h + l, come off
// in fp32 per group. Symmetric (zero null): xz [MR][G][16], the int32 lanes of -8 * (256 h + l) summed as
// dpbusd sums them (symmetric_lanes), start each group's l sums, so the 8 comes off in the integer sums.
template <int MR, int NR, bool ZP, bool STREAM = false>
void int4_limb_rows(const int8_t* xh, const int8_t* xl, int64_t K, const float* xs, const float* xg,
                    const int32_t* xz, const uint8_t* w, const float* scale, const float* zero, int64_t group,
                    int64_t n, float* y, int64_t ldy) {
  static_assert(!STREAM || NR == 1, "the stream kernel reads one weight row at a time");
  const int64_t G = K / group, chunks = group / 128;
  __m512 f[MR][NR];
  float corr[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) f[r][j] = _mm512_setzero_ps(), corr[r][j] = 0.0f;
  for (int64_t g = 0; g < G; ++g) {
    __m512i ah[MR][NR], al[MR][NR];
    for (int r = 0; r < MR; ++r) {
      const __m512i start = ZP ? _mm512_setzero_si512() : _mm512_loadu_si512(xz + (r * G + g) * 16);
      for (int j = 0; j < NR; ++j) ah[r][j] = _mm512_setzero_si512(), al[r][j] = start;
    }
    for (int64_t c = g * chunks; c < (g + 1) * chunks; ++c) {
      __m512i h0[MR], h1[MR], l0[MR], l1[MR];
      for (int r = 0; r < MR; ++r) {
        const int8_t* ph = xh + r * K + c * 128;
        const int8_t* pl = xl + r * K + c * 128;
        h0[r] = _mm512_loadu_si512(ph), h1[r] = _mm512_loadu_si512(ph + 64);
        l0[r] = _mm512_loadu_si512(pl), l1[r] = _mm512_loadu_si512(pl + 64);
      }
      // one weight row's nibbles at a time, so few registers hold them
      for (int j = 0; j < NR; ++j) {
        const uint8_t* wj = w + (n + j) * (K / 2) + c * 64;  // prefetched NR rows ahead, as int8_limb_rows
        if (STREAM)
          _mm_prefetch(reinterpret_cast<const char*>(wj + kStreamAhead), _MM_HINT_T1);
        else
          _mm_prefetch(reinterpret_cast<const char*>(wj + NR * (K / 2)), _MM_HINT_T0);
        __m512i lo, hi;
        nibbles(wj, lo, hi);
        for (int r = 0; r < MR; ++r) {
          ah[r][j] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(ah[r][j], lo, h0[r]), hi, h1[r]);
          al[r][j] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(al[r][j], lo, l0[r]), hi, l1[r]);
        }
      }
    }
    for (int j = 0; j < NR; ++j) {
      const __m512 sv = _mm512_set1_ps(scale[(n + j) * G + g]);
      for (int r = 0; r < MR; ++r) {
        const __m512i d = _mm512_add_epi32(_mm512_slli_epi32(ah[r][j], 8), al[r][j]);
        f[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), sv, f[r][j]);
        if (ZP) corr[r][j] += scale[(n + j) * G + g] * zero[(n + j) * G + g] * xg[r * G + g];
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) y[r * ldy + n + j] = (_mm512_reduce_add_ps(f[r][j]) - corr[r][j]) * xs[r];
}

// One row of x against int4 weight rows n0..n1 in groups of 128 (one chunk each) (stream_rows()), the sums
// int4_limb_rows<1, 1, ZP, true> makes, each group's chunk taken straight in the row loop (the general kernel's
// inner loop over a group's chunks, run once a group at 128, made a 1.1B model's projections take 1.03-1.12x as
// long). Rows n and n + half go together: x's limbs are loaded once for two weight rows, and each half of the
// weight is read as the one run of memory it is, two streams at once (the 1.1B model's int4 step took 1.06-1.15x
// as long with one row after another; adjacent rows side by side read far slower: bench/README.md, 'Measurements
// behind the code'). Each line's read brings the line kStreamAhead bytes on into L2, as in int4_limb_rows.
template <bool ZP>
void int4_stream_rows_g128(const int8_t* xh, const int8_t* xl, int64_t K, const float* xs, const float* xg,
                           const int32_t* xz, const uint8_t* w, const float* scale, const float* zero, int64_t n0,
                           int64_t n1, float* y) {
  const int64_t G = K / 128;
  // row n's group g against the limbs h0 h1 l0 l1 (and the symmetric start), into f (and its zero points' corr)
  auto group = [&](int64_t n, int64_t g, __m512i h0, __m512i h1, __m512i l0, __m512i l1, __m512i start, __m512& f,
                   float& corr) {
    const uint8_t* wg = w + n * (K / 2) + g * 64;
    _mm_prefetch(reinterpret_cast<const char*>(wg + kStreamAhead), _MM_HINT_T1);
    __m512i lo, hi;
    nibbles(wg, lo, hi);
    const __m512i ah = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, h0), hi, h1);
    const __m512i al = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(start, lo, l0), hi, l1);
    const float s = scale[n * G + g];
    f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(ah, 8), al)), _mm512_set1_ps(s), f);
    if (ZP) corr += s * zero[n * G + g] * xg[g];
  };
  row_pairs(n0, n1, [&](int64_t a, int64_t b) {
    __m512 fa = _mm512_setzero_ps(), fb = _mm512_setzero_ps();
    float ca = 0.0f, cb = 0.0f;
    for (int64_t g = 0; g < G; ++g) {
      const int8_t *ph = xh + g * 128, *pl = xl + g * 128;
      const __m512i h0 = _mm512_loadu_si512(ph), h1 = _mm512_loadu_si512(ph + 64);
      const __m512i l0 = _mm512_loadu_si512(pl), l1 = _mm512_loadu_si512(pl + 64);
      const __m512i start = ZP ? _mm512_setzero_si512() : _mm512_loadu_si512(xz + g * 16);
      group(a, g, h0, h1, l0, l1, start, fa, ca);
      if (b >= 0) group(b, g, h0, h1, l0, l1, start, fb, cb);
    }
    y[a] = (_mm512_reduce_add_ps(fa) - ca) * xs[0];
    if (b >= 0) y[b] = (_mm512_reduce_add_ps(fb) - cb) * xs[0];
  });
}

// xz for int4_limb_rows' symmetric case: per row and group, the 16 int32 lanes of -8 * (256 h + l) summed over
// the group's chunks in dpbusd's lanes (lane i: bytes 4i..4i+3 of each 64-byte half)
std::vector<int32_t> symmetric_lanes(const int8_t* xh, const int8_t* xl, int64_t M, int64_t K, int64_t group) {
  const int64_t G = K / group;
  std::vector<int32_t> out(M * G * 16);
  const __m512i ones = _mm512_set1_epi8(1);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      __m512i h = _mm512_setzero_si512(), l = _mm512_setzero_si512();
      for (int64_t k = g * group; k < (g + 1) * group; k += 64) {
        h = _mm512_dpbusd_epi32(h, ones, _mm512_loadu_si512(xh + m * K + k));
        l = _mm512_dpbusd_epi32(l, ones, _mm512_loadu_si512(xl + m * K + k));
      }
      const __m512i v = _mm512_add_epi32(_mm512_slli_epi32(h, 8), l);
      _mm512_storeu_si512(out.data() + (m * G + g) * 16, _mm512_mullo_epi32(v, _mm512_set1_epi32(-8)));
    }
  return out;
}

#else  // TM_QUANT_AVX2: the fp32 path's row kernels, 16-bit fixed point x against integer weights
//
// Widening every weight to float (a sign extension, a conversion, an FMA per 8) costs one AVX2 core more
// instructions than it streams bytes from memory, so here each row of x becomes 16-bit fixed point,
// x ~ s * v with s = amax / 32767 and |v| <= 32767 (rounded half to even; within amax * 2^-16 of x), and the
// weights are widened only to int16: vpmaddwd multiplies 16 of them by v and adds pairs into int32, exactly.

constexpr int64_t kFixedChunk = 4096;  // k per int32 run: 256 vpmaddwd sums of at most 2 * 128 * 32767 each
// weight rows ahead that a block prefetches, at its own k: rows of a few KiB end before the hardware prefetchers
// run ahead, and one block ahead was too close (2 KiB rows of a 1.1B model: 11-12 GB/s a core, 13-14 at 16 rows)
constexpr int64_t kPrefetchRows = 16;

using tokenmill::hsum8;

// MR rows of fp32 x (ldx apart, zero from K to Kp, Kp a multiple of 16) as fixed point: v [MR][Kp], s [MR]
template <int MR>
void fixed_rows(const float* x, int64_t ldx, int64_t Kp, int16_t* v, float* s) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int r = 0; r < MR; ++r) {
    const float* xr = x + r * ldx;
    __m256 amax = _mm256_setzero_ps();
    for (int64_t k = 0; k < Kp; k += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(xr + k)));
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    s[r] = std::max(_mm_cvtss_f32(m), 1e-30f) / 32767.0f;
    const __m256 inv = _mm256_set1_ps(1.0f / s[r]);
    const __m256i lim = _mm256_set1_epi32(32767), nlim = _mm256_set1_epi32(-32767);
    for (int64_t k = 0; k < Kp; k += 16) {
      __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xr + k), inv));
      __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xr + k + 8), inv));
      a = _mm256_min_epi32(_mm256_max_epi32(a, nlim), lim);
      b = _mm256_min_epi32(_mm256_max_epi32(b, nlim), lim);
      // packs works within 128-bit lanes: a0-3 b0-3 a4-7 b4-7, put back in order
      const __m256i p = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(v + r * Kp + k), p);
    }
  }
}

// MR fixed-point rows (v [MR][Kp], scales xs) against NR int8 weight rows from n, prefetching kPrefetchRows ahead
template <int MR, int NR>
void int8_block(const int16_t* v, int64_t Kp, const float* xs, const int8_t* w, const float* scale, int64_t K,
                int64_t n, float* y, int64_t ldy) {
  __m256 f[MR][NR];
  #pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
    #pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) f[r][j] = _mm256_setzero_ps();
  const int64_t K16 = K / 16 * 16;
  for (int64_t c = 0; c < K16; c += kFixedChunk) {
    __m256i a[MR][NR];
    #pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
      #pragma GCC unroll 8
      for (int j = 0; j < NR; ++j) a[r][j] = _mm256_setzero_si256();
    const int64_t c_end = std::min(K16, c + kFixedChunk);
    for (int64_t k = c; k < c_end; k += 16) {
      #pragma GCC unroll 8
      for (int j = 0; j < NR; ++j) {
        const int8_t* wj = w + (n + j) * K + k;
        _mm_prefetch(reinterpret_cast<const char*>(wj + kPrefetchRows * K), _MM_HINT_T0);
        const __m256i wv = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wj)));
        #pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
          const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + r * Kp + k));
          a[r][j] = _mm256_add_epi32(a[r][j], _mm256_madd_epi16(wv, xv));
        }
      }
    }
    #pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
      #pragma GCC unroll 8
      for (int j = 0; j < NR; ++j) f[r][j] = _mm256_add_ps(f[r][j], _mm256_cvtepi32_ps(a[r][j]));
  }
  #pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
    #pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) {
      float t = hsum8(f[r][j]);
      for (int64_t k = K16; k < K; ++k) t += static_cast<float>(v[r * Kp + k] * w[(n + j) * K + k]);
      y[r * ldy + n + j] = t * xs[r] * scale[n + j];
    }
}

template <int MR>
void int8_rows(const float* x, int64_t ldx, const int8_t* w, const float* scale, int64_t K, int64_t n0,
               int64_t n1, float* y, int64_t ldy) {
  constexpr int NR = MR == 1 ? 8 : 2;
  const int64_t Kp = round_up(K, 16);
  std::vector<int16_t> v(MR * Kp);
  float xs[MR];
  fixed_rows<MR>(x, ldx, Kp, v.data(), xs);
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) int8_block<MR, NR>(v.data(), Kp, xs, w, scale, K, n, y, ldy);
  for (; n < n1; ++n) int8_block<MR, 1>(v.data(), Kp, xs, w, scale, K, n, y, ldy);
}

// MR fixed-point rows (v [MR][Kp], Kp = K padded to 32, scales xs, each group's sums of v in vg [MR][G])
// against NR int4 rows (the packed layout) from n: per group, the integer products of the unsigned nibbles,
// scaled, less the zero point times the group's sum of v (once per group, as int4_rows on AVX-512).
template <int MR, int NR>
void int4_block(const int16_t* v, int64_t Kp, const float* xs, const int32_t* vg, const uint8_t* w,
                const float* scale, const float* zero, int64_t K, int64_t group, int64_t n, float* y, int64_t ldy) {
  const int64_t G = (K + group - 1) / group, row = Kp / 2;
  const __m256i nib = _mm256_set1_epi16(0x0F);
  __m256 f[MR][NR];
  float corr[MR][NR];
  #pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
    #pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) f[r][j] = _mm256_setzero_ps(), corr[r][j] = 0.0f;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t k_end = std::min(Kp, (g + 1) * group);
    __m256i a[MR][NR];
    #pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
      #pragma GCC unroll 8
      for (int j = 0; j < NR; ++j) a[r][j] = _mm256_setzero_si256();
    for (int64_t k = g * group; k < k_end; k += 32) {
      #pragma GCC unroll 8
      for (int j = 0; j < NR; ++j) {
        const uint8_t* wj = w + (n + j) * row + k / 2;
        _mm_prefetch(reinterpret_cast<const char*>(wj + kPrefetchRows * row), _MM_HINT_T0);
        const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wj)));
        const __m256i lo = _mm256_and_si256(b, nib), hi = _mm256_srli_epi16(b, 4);  // k .. k+15, k+16 .. k+31
        #pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
          const int16_t* vr = v + r * Kp + k;
          const __m256i d = _mm256_add_epi32(
              _mm256_madd_epi16(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(vr))),
              _mm256_madd_epi16(hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(vr + 16))));
          a[r][j] = _mm256_add_epi32(a[r][j], d);
        }
      }
    }
    #pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) {
      const float sc = scale[(n + j) * G + g], sz = sc * (zero ? zero[(n + j) * G + g] : 8.0f);
      const __m256 sv = _mm256_set1_ps(sc);
      #pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        f[r][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[r][j]), sv, f[r][j]);
        corr[r][j] += sz * static_cast<float>(vg[r * G + g]);
      }
    }
  }
  #pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
    #pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) y[r * ldy + n + j] = (hsum8(f[r][j]) - corr[r][j]) * xs[r];
}

// the AVX-512 int4_rows' signature; xsum (x's per-group sums in fp32) is not read: the fixed-point rows' own
// integer sums take its place
template <int MR>
void int4_rows(const float* x, int64_t ldx, const float*, const uint8_t* w, const float* scale,
               const float* zero, int64_t K, int64_t group, int64_t n0, int64_t n1, float* y, int64_t ldy) {
  constexpr int NR = MR == 1 ? 4 : 2;
  const int64_t Kp = round_up(K, 32), G = (K + group - 1) / group;
  std::vector<int16_t> v(MR * Kp);
  std::vector<int32_t> vg(MR * G, 0);
  float xs[MR];
  fixed_rows<MR>(x, ldx, Kp, v.data(), xs);
  for (int r = 0; r < MR; ++r)
    for (int64_t g = 0; g < G; ++g) {
      int32_t sum = 0;
      for (int64_t k = g * group, k_end = std::min(K, (g + 1) * group); k < k_end; ++k) sum += v[r * Kp + k];
      vg[r * G + g] = sum;
    }
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) int4_block<MR, NR>(v.data(), Kp, xs, vg.data(), w, scale, zero, K, group, n, y, ldy);
  for (; n < n1; ++n) int4_block<MR, 1>(v.data(), Kp, xs, vg.data(), w, scale, zero, K, group, n, y, ldy);
}

#endif  // TM_QUANT_AVX512

// rows of x in tiles of up to kRowTile, each tile over every output; outputs split across threads
template <typename Fn>
void over_tiles(int64_t M, int64_t N, Fn fn) {
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t m = 0; m < M; m += kRowTile) fn(m, std::min(kRowTile, M - m), n0, n1);
  });
}

#ifdef TM_QUANT_AVX512
// x's rows as limbs for the *_limb_rows kernels: xh, xl [M, Kp] (dest: byte offset of k's 16 limbs),
// xs [M], and with group > 0 the per-group sums xg [M, Kp / group]
// h and l start on a cache line, as the kernels' 64-byte loads of them then each read one line
struct alignas(64) LimbLine {
  int8_t b[64];
};
struct LimbBuffer {
  std::vector<LimbLine> lines;
  int8_t* data() { return lines.data()->b; }
  const int8_t* data() const { return lines.data()->b; }
};
struct Limbs {
  LimbBuffer h, l;
  std::vector<float> s, g;
};

template <typename Dest>
Limbs split_rows(const at::Tensor& x, int64_t Kp, bool offset, Dest dest, int64_t group) {
  const int64_t M = x.size(0), K = x.size(1);
  const auto lines = static_cast<size_t>((M * Kp + 63) / 64);
  Limbs out{{std::vector<LimbLine>(lines)}, {std::vector<LimbLine>(lines)}, std::vector<float>(M),
            std::vector<float>(group > 0 ? M * (Kp / group) : 0, 0.0f)};
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  for (int64_t m = 0; m < M; ++m) {
    out.s[m] = split_row(xp + m * x.stride(0), K, Kp, offset, dest, out.h.data() + m * Kp, out.l.data() + m * Kp,
                         group, group > 0 ? out.g.data() + m * (Kp / group) : nullptr);
  }
  return out;
}

// y fp32 [M, N] (+ bias) as x's dtype
at::Tensor store_rows(const std::vector<float>& y, int64_t M, int64_t N, const c10::optional<at::Tensor>& bias,
                      const at::Tensor& x) {
  at::Tensor out = at::empty({M, N}, x.options());
  const bool has_bias = bias.has_value() && bias->defined();
  const at::Tensor b = has_bias ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const float* bp = has_bias ? b.data_ptr<float>() : nullptr;
  auto* op = out.data_ptr<at::BFloat16>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) op[m * N + n] = static_cast<at::BFloat16>(y[m * N + n] + (bp ? bp[n] : 0.0f));
  return out;
}

bool limb_path(const at::Tensor& x) {
  return x.scalar_type() == at::kBFloat16 && x.size(0) <= kVectorMaxRows && x.stride(1) == 1;
}
#endif  // TM_QUANT_AVX512

// rows n0..n1 of one row tile, NR outputs at a time, then the rest one by one
template <int MR, int NR, typename Fn1, typename FnN>
void n_blocks(int64_t n0, int64_t n1, Fn1 one, FnN many) {
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) many(n);
  for (; n < n1; ++n) one(n);
}

// more bf16 rows than the limb kernels take, up to kAmxMaxRows, where AMX-BF16 runs: the weight dequantized a
// block at a time (linear/dequant_amx.cpp). Past kAmxMaxRows the float sums each thread keeps across K's slices
// outgrow L2, and the dequantized weight's matmul is faster.
constexpr int64_t kAmxMaxRows = 256;  // the layer's AMX_MAX_ROWS
bool amx_rows(const at::Tensor& x) {
  return x.scalar_type() == at::kBFloat16 && x.size(0) > kVectorMaxRows && x.size(0) <= kAmxMaxRows &&
         x.stride(1) == 1 && tokenmill::dequant_amx_available();
}

#define TM_ROW_TILES(MR_, CALL)                                                                         \
  switch (MR_) {                                                                                        \
    case 1: CALL(1, 4); break;                                                                          \
    case 2: CALL(2, 2); break;                                                                          \
    case 3: CALL(3, 2); break;                                                                          \
    default: CALL(4, 1); break;                                                                         \
  }

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale, const at::Tensor& wsum,
                       const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(weight.scalar_type() == at::kChar && weight.dim() == 2 && weight.is_contiguous(), "int8_linear: weight");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == weight.size(0), "int8_linear: scale");
  TORCH_CHECK(wsum.scalar_type() == at::kInt && wsum.is_contiguous() && wsum.numel() == weight.size(0),
              "int8_linear: wsum");
  const int64_t N = weight.size(0), K = weight.size(1), M = x.size(0);
  check_x(x, K, "int8_linear");
  const int8_t* wp = weight.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  if (amx_rows(x)) {
    tokenmill::QuantWeight q;
    q.w8 = wp, q.scale = sp, q.N = N, q.K = K, q.Kp = round_up(K, 32);
    return tokenmill::dequant_amx_linear(x, q, bias);
  }
#ifdef TM_QUANT_AVX512
  if (limb_path(x)) {
    const int64_t Kp = round_up(K, 64);
    const Limbs xl = split_rows(x, Kp, true, [](int64_t k) { return k; }, 0);
    std::vector<float> y(M * N);
    const int32_t* ws = wsum.data_ptr<int32_t>();
    over_tiles(M, N, [&](int64_t m, int64_t mr, int64_t n0, int64_t n1) {
      const auto* h = reinterpret_cast<const uint8_t*>(xl.h.data() + m * Kp);
      const auto* l = reinterpret_cast<const uint8_t*>(xl.l.data() + m * Kp);
      const float* s = xl.s.data() + m;
      float* ym = y.data() + m * N;
#define TM_INT8(MR, NR)                                                                               \
  n_blocks<MR, NR>(                                                                                   \
      n0, n1, [&](int64_t n) { int8_limb_rows<MR, 1>(h, l, Kp, s, wp, sp, ws, K, n, ym, N); },          \
      [&](int64_t n) { int8_limb_rows<MR, NR>(h, l, Kp, s, wp, sp, ws, K, n, ym, N); })
      if (mr == 1 && stream_rows()) {
        int8_stream_rows(h, l, s, wp, sp, ws, K, n0, n1, ym);
      } else {
        TM_ROW_TILES(mr, TM_INT8)
      }
#undef TM_INT8
    });
    return store_rows(y, M, N, bias, x);
  }
#endif
  const int64_t Kp = round_up(K, 16);
  auto xf = padded_fp32(x, Kp);
  auto y = at::empty({M, N}, x.options().dtype(at::kFloat));
  const float* xp = xf.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  over_tiles(M, N, [&](int64_t m, int64_t mr, int64_t n0, int64_t n1) {
    const float* xm = xp + m * Kp;
    float* ym = yp + m * N;
    switch (mr) {
      case 1: int8_rows<1>(xm, Kp, wp, sp, K, n0, n1, ym, N); break;
      case 2: int8_rows<2>(xm, Kp, wp, sp, K, n0, n1, ym, N); break;
      case 3: int8_rows<3>(xm, Kp, wp, sp, K, n0, n1, ym, N); break;
      default: int8_rows<4>(xm, Kp, wp, sp, K, n0, n1, ym, N); break;
    }
  });
  return finish(y, bias, x);
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale, const at::Tensor& zero,
                       int64_t in_features, int64_t group, const c10::optional<at::Tensor>& bias) {
  const int64_t K = in_features, Kp = round_up(K, 32), N = weight.size(0), M = x.size(0);
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.dim() == 2 && weight.size(1) == Kp / 2 &&
              weight.is_contiguous(), "int4_linear: weight must be uint8 [N, ", Kp / 2, "]");
  TORCH_CHECK(group > 0 && (group % 32 == 0 || group >= K), "int4_linear: group ", group,
              " is not a multiple of 32 and does not cover K");
  const int64_t G = (K + group - 1) / group;
  for (const auto* t : {&scale, &zero}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && (t->numel() == N * G || (t == &zero && t->numel() == 0)),
                "int4_linear: scale and zero must be fp32 [N, ", G, "] (zero empty: symmetric, 8 throughout)");
  }
  check_x(x, K, "int4_linear");
  const uint8_t* wp = weight.data_ptr<uint8_t>();
  const float *sp = scale.data_ptr<float>(), *zp = zero.numel() ? zero.data_ptr<float>() : nullptr;
  if (amx_rows(x)) {
    tokenmill::QuantWeight q;
    q.w4 = wp, q.scale = sp, q.zero = zp, q.N = N, q.K = K, q.Kp = Kp, q.group = group, q.groups = G;
    return tokenmill::dequant_amx_linear(x, q, bias);
  }
  // the limb kernels take whole chunks of 128 k per group; a group's int32 sums stay under 2^31 below 2^15
#ifdef TM_QUANT_AVX512
  if (limb_path(x) && K % 128 == 0 && group % 128 == 0 && group <= 32768 && K % group == 0) {
    const Limbs xl = split_rows(x, K, false, [](int64_t k) {
      const int64_t b = (k % 128) / 16;
      return k / 128 * 128 + (b % 2) * 64 + (b / 2) * 16;
    }, group);
    const std::vector<int32_t> xz = zp ? std::vector<int32_t>() : symmetric_lanes(xl.h.data(), xl.l.data(), M, K, group);
    std::vector<float> y(M * N);
    over_tiles(M, N, [&](int64_t m, int64_t mr, int64_t n0, int64_t n1) {
      const int8_t* h = xl.h.data() + m * K;
      const int8_t* l = xl.l.data() + m * K;
      const float* s = xl.s.data() + m;
      const float* g = xl.g.data() + m * G;
      const int32_t* z = zp ? nullptr : xz.data() + m * G * 16;
      float* ym = y.data() + m * N;
#define TM_INT4_ZP(MR, NR, ZP)                                                                        \
  n_blocks<MR, NR>(                                                                                   \
      n0, n1, [&](int64_t n) { int4_limb_rows<MR, 1, ZP>(h, l, K, s, g, z, wp, sp, zp, group, n, ym, N); }, \
      [&](int64_t n) { int4_limb_rows<MR, NR, ZP>(h, l, K, s, g, z, wp, sp, zp, group, n, ym, N); })
#define TM_INT4(MR, NR)                                                                               \
  if (zp) TM_INT4_ZP(MR, NR, true); else TM_INT4_ZP(MR, NR, false)
      if (mr == 1 && stream_rows() && group == 128) {
        if (zp) int4_stream_rows_g128<true>(h, l, K, s, g, z, wp, sp, zp, n0, n1, ym);
        else int4_stream_rows_g128<false>(h, l, K, s, g, z, wp, sp, zp, n0, n1, ym);
      } else if (mr == 1 && stream_rows()) {
        for (int64_t n = n0; n < n1; ++n) {
          if (zp) int4_limb_rows<1, 1, true, true>(h, l, K, s, g, z, wp, sp, zp, group, n, ym, N);
          else int4_limb_rows<1, 1, false, true>(h, l, K, s, g, z, wp, sp, zp, group, n, ym, N);
        }
      } else {
        TM_ROW_TILES(mr, TM_INT4)
      }
#undef TM_INT4
#undef TM_INT4_ZP
    });
    return store_rows(y, M, N, bias, x);
  }
#endif
  auto xf = padded_fp32(x, Kp);
#ifdef TM_QUANT_AVX512
  // each row's sum over each group (the padding is zero)
  auto xsum = at::zeros({M, G * group}, xf.options());
  xsum.narrow(1, 0, std::min(Kp, G * group)).copy_(xf.narrow(1, 0, std::min(Kp, G * group)));
  xsum = xsum.view({M, G, group}).sum(2).contiguous();
  const float* xs = xsum.data_ptr<float>();
#else  // the fixed-point rows' own sums take its place
  const float* xs = nullptr;
#endif
  auto y = at::empty({M, N}, x.options().dtype(at::kFloat));
  const float* xp = xf.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  over_tiles(M, N, [&](int64_t m, int64_t mr, int64_t n0, int64_t n1) {
    const float* xm = xp + m * Kp;
    const float* xsm = xs ? xs + m * G : nullptr;
    float* ym = yp + m * N;
    switch (mr) {
      case 1: int4_rows<1>(xm, Kp, xsm, wp, sp, zp, K, group, n0, n1, ym, N); break;
      case 2: int4_rows<2>(xm, Kp, xsm, wp, sp, zp, K, group, n0, n1, ym, N); break;
      case 3: int4_rows<3>(xm, Kp, xsm, wp, sp, zp, K, group, n0, n1, ym, N); break;
      default: int4_rows<4>(xm, Kp, xsm, wp, sp, zp, K, group, n0, n1, ym, N); break;
    }
  });
  return finish(y, bias, x);
}

#ifdef TM_QUANT_AVX512
// One row of n values, 16 at a time as load(k) gives them (zero past the row), as unsigned int8 (q +
// kRowZeroPoint) in q[0, n); returns its scale. ref.quantize_rows rounds the same way: amax / 127, half to even.
template <typename Load>
float quantize_row(Load load, int64_t n, uint8_t* q) {
  __m512 amax = _mm512_setzero_ps();
  for (int64_t k = 0; k < n; k += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(load(k)));
  const float s = std::max(_mm512_reduce_max_ps(amax), 1e-10f) / 127.0f;
  const __m512 sv = _mm512_set1_ps(s);
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
  const __m512i off = _mm512_set1_epi32(static_cast<int>(tokenmill::kRowZeroPoint));
  for (int64_t k = 0; k < n; k += 16) {
    __m512i v = _mm512_cvtps_epi32(_mm512_div_ps(load(k), sv));  // round half to even
    v = _mm512_add_epi32(_mm512_min_epi32(_mm512_max_epi32(v, lo), hi), off);
    _mm_mask_storeu_epi8(q + k, tokenmill::first_lanes(n - k), _mm512_cvtepi32_epi8(v));
  }
  return s;
}

// each row of x (fp32 [M, Kp], Kp a multiple of 16) as unsigned int8 (q + 128) [M, Kp] and its scale [M]
void quantize_rows(const float* x, int64_t M, int64_t Kp, uint8_t* q, float* xs) {
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* xm = x + m * Kp;
      xs[m] = quantize_row([&](int64_t k) { return _mm512_loadu_ps(xm + k); }, Kp, q + m * Kp);
    }
  });
}

at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale, const at::Tensor& wsum,
                       int64_t in_features, const c10::optional<at::Tensor>& bias) {
  const int64_t K = in_features, Kp = round_up(K, 64), N = weight.size(0), M = x.size(0);
  TORCH_CHECK(weight.scalar_type() == at::kChar && weight.dim() == 2 && weight.size(1) == Kp &&
              weight.is_contiguous(), "w8a8_linear: weight must be int8 [N, ", Kp, "]");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == N, "w8a8_linear: scale");
  TORCH_CHECK(wsum.scalar_type() == at::kInt && wsum.numel() == N, "w8a8_linear: wsum");
  check_x(x, K, "w8a8_linear");
  auto xf = padded_fp32(x, Kp);
  std::vector<uint8_t> xq(M * Kp);
  std::vector<float> xs(M);
  quantize_rows(xf.data_ptr<float>(), M, Kp, xq.data(), xs.data());
  auto y = at::empty({M, N}, x.options().dtype(at::kFloat));
  const int8_t* wp = weight.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  const int32_t* wsp = wsum.data_ptr<int32_t>();
  float* yp = y.data_ptr<float>();
  over_tiles(M, N, [&](int64_t m, int64_t mr, int64_t n0, int64_t n1) {
    const uint8_t* xm = xq.data() + m * Kp;
    const float* xsm = xs.data() + m;
    float* ym = yp + m * N;
    switch (mr) {
      case 1: w8a8_rows<1>(xm, Kp, wp, xsm, sp, wsp, n0, n1, ym, N); break;
      case 2: w8a8_rows<2>(xm, Kp, wp, xsm, sp, wsp, n0, n1, ym, N); break;
      case 3: w8a8_rows<3>(xm, Kp, wp, xsm, sp, wsp, n0, n1, ym, N); break;
      default: w8a8_rows<4>(xm, Kp, wp, xsm, sp, wsp, n0, n1, ym, N); break;
    }
  });
  return finish(y, bias, x);
}

// W8A8 beyond the VNNI kernel's rows (oneDNN's int8 matmul runs the product): x [M, K] (bf16 or fp32) ->
// (q uint8 [M, K], scale fp32 [M]), each row rounded as quantize_rows rounds it (amax / 127, half to even) and
// stored plus 128, for oneDNN's u8 source with zero point 128: the integer products are the signed ones exactly.
// oneDNN runs an int8 matmul with a signed source only with AMX-INT8; elsewhere (AVX-512 VNNI) that source took
// its reference implementation, and torch's prepacked weight carries the compensation a u8 source needs
std::tuple<at::Tensor, at::Tensor> quantize_rows_uint8(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "quantize_rows_uint8: x must be contiguous [M, K]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "quantize_rows_uint8: bf16 or fp32");
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor q = at::empty({M, K}, x.options().dtype(at::kByte));
  at::Tensor scale = at::empty({M}, x.options().dtype(at::kFloat));
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const char* xp = static_cast<const char*>(x.data_ptr());
  uint8_t* qp = q.data_ptr<uint8_t>();
  float* sp = scale.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      auto load = [&](int64_t k) {
        if (bf16) return load_bf16(reinterpret_cast<const uint16_t*>(xp) + m * K, k, K);
        return _mm512_maskz_loadu_ps(tokenmill::first_lanes(K - k), reinterpret_cast<const float*>(xp) + m * K + k);
      };
      sp[m] = quantize_row(load, K, qp + m * K);
    }
  });
  return {q, scale};
}

// y fp32 [M, N] (the integer products times each output's scale) times each row's scale, plus bias, as dtype
at::Tensor scale_rows(const at::Tensor& y, const at::Tensor& row_scale, const c10::optional<at::Tensor>& bias,
                      at::ScalarType dtype) {
  TORCH_CHECK(y.dim() == 2 && y.is_contiguous() && y.scalar_type() == at::kFloat, "scale_rows: y must be fp32 [M, N]");
  TORCH_CHECK(row_scale.scalar_type() == at::kFloat && row_scale.numel() == y.size(0), "scale_rows: row_scale");
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "scale_rows: bf16 or fp32 out");
  const int64_t M = y.size(0), N = y.size(1);
  const bool has_bias = bias.has_value() && bias->defined();
  const at::Tensor b = has_bias ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const float* bp = has_bias ? b.data_ptr<float>() : nullptr;
  at::Tensor out = at::empty({M, N}, y.options().dtype(dtype));
  const float* yp = y.data_ptr<float>();
  const float* rs = row_scale.data_ptr<float>();
  at::BFloat16* ob = dtype == at::kBFloat16 ? out.data_ptr<at::BFloat16>() : nullptr;
  float* of = dtype == at::kFloat ? out.data_ptr<float>() : nullptr;
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t n = 0; n < N; ++n) {
        const float v = yp[m * N + n] * rs[m] + (bp ? bp[n] : 0.0f);
        if (ob) ob[m * N + n] = static_cast<at::BFloat16>(v);
        else of[m * N + n] = v;
      }
  });
  return out;
}

bool has_quantized_linear() { return true; }

#endif  // TM_QUANT_AVX512

bool has_weight_only_linear() { return true; }

}  // namespace

#else  // neither AVX-512 BW/VNNI nor AVX2: the quantized methods keep their torch reference path

namespace {

[[noreturn]] void unavailable() { TORCH_CHECK(false, "quantized linear kernels: built without AVX512-BW/VNNI or AVX2"); }

at::Tensor int8_linear(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                       const c10::optional<at::Tensor>&) {
  unavailable();
}
at::Tensor int4_linear(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t,
                       const c10::optional<at::Tensor>&) {
  unavailable();
}
bool has_weight_only_linear() { return false; }

}  // namespace

#endif

#ifndef TM_QUANT_AVX512  // W8A8 keeps its torch reference path

namespace {

[[noreturn]] void w8a8_unavailable() { TORCH_CHECK(false, "W8A8 linear kernels: built without AVX512-BW/VNNI"); }

at::Tensor w8a8_linear(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                       const c10::optional<at::Tensor>&) {
  w8a8_unavailable();
}
std::tuple<at::Tensor, at::Tensor> quantize_rows_uint8(const at::Tensor&) { w8a8_unavailable(); }
at::Tensor scale_rows(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&, at::ScalarType) {
  w8a8_unavailable();
}
bool has_quantized_linear() { return false; }

}  // namespace

#endif

namespace {

// The bf16 [N, K] weight an int8 (weight int8 [N, K], scale [N]) or int4 (the packed layout above, scale and zero
// [N, ceil(K / group)], zero empty: 8) layer multiplies by: the reference's float32 values (q * scale, (q - zero) *
// scale; layers/quantization/reference.py) rounded to bf16 as at::to rounds them, for the matmuls of more rows than
// the kernels take. Portable C++: the compiler vectorizes the row loops.
at::Tensor dequantize_bf16(const at::Tensor& weight, const at::Tensor& scale, const at::Tensor& zero,
                           int64_t in_features, int64_t group) {
  const bool int4 = weight.scalar_type() == at::kByte;
  TORCH_CHECK((int4 || weight.scalar_type() == at::kChar) && weight.dim() == 2 && weight.is_contiguous(),
              "dequantize_bf16: weight must be contiguous int8 [N, K] or packed int4 uint8 [N, Kp / 2]");
  const int64_t N = weight.size(0), K = in_features;
  const int64_t G = int4 ? (K + group - 1) / group : 1;
  TORCH_CHECK(!int4 || (group > 0 && (group % 32 == 0 || group >= K) && weight.size(1) == round_up(K, 32) / 2),
              "dequantize_bf16: int4 weight must be uint8 [N, ", round_up(K, 32) / 2, "] with a group that is a "
              "multiple of 32 or covers K");
  TORCH_CHECK(int4 || weight.size(1) == K, "dequantize_bf16: int8 weight must be [N, ", K, "]");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == N * G,
              "dequantize_bf16: scale must be fp32 [N, ", G, "]");
  TORCH_CHECK(zero.numel() == 0 || (int4 && zero.scalar_type() == at::kFloat && zero.is_contiguous() &&
                                    zero.numel() == N * G), "dequantize_bf16: zero must be empty or fp32 [N, ", G, "]");
  at::Tensor out = at::empty({N, K}, weight.options().dtype(at::kBFloat16));
  const float* sp = scale.data_ptr<float>();
  const float* zp = zero.numel() ? zero.data_ptr<float>() : nullptr;
  auto* op = out.data_ptr<at::BFloat16>();
  const int64_t width = weight.size(1);
  const auto* w4 = int4 ? weight.data_ptr<uint8_t>() : nullptr;
  const auto* w8 = int4 ? nullptr : weight.data_ptr<int8_t>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    std::vector<float> row(round_up(K, 32));
    for (int64_t n = n0; n < n1; ++n) {
      if (int4) {
        const uint8_t* w = w4 + n * width;
        // runs of 32 k (byte j: k = j in its low nibble, k = j + 16 in its high one), each inside one group (group
        // is a multiple of 32 or covers all of K)
        for (int64_t k0 = 0; k0 < K; k0 += 32) {
          const int64_t g = n * G + k0 / group;
          const float z = zp ? zp[g] : 8.0f, sc = sp[g];
          const uint8_t* b = w + k0 / 2;
          for (int j = 0; j < 16; ++j) {
            row[k0 + j] = (static_cast<float>(b[j] & 0xF) - z) * sc;
            row[k0 + 16 + j] = (static_cast<float>(b[j] >> 4) - z) * sc;
          }
        }
      } else {
        const int8_t* w = w8 + n * K;
        const float sc = sp[n];
        for (int64_t k = 0; k < K; ++k) row[k] = static_cast<float>(w[k]) * sc;
      }
      // round to nearest even, as at::to rounds finite values
      uint16_t* o = reinterpret_cast<uint16_t*>(op + n * K);
      for (int64_t k = 0; k < K; ++k) {
        uint32_t u;
        std::memcpy(&u, &row[k], sizeof u);
        o[k] = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
      }
    }
  });
  return out;
}

// Round-to-nearest of a float weight [N, K] (bf16, fp16 or fp32) into the layouts above, in one pass a row: the
// values of layers/quantization/reference.py's rtn_int8 (then weight_sum) and rtn_int4 (then pack_int4), op for op
// in fp32 (w / scale, then + zero, rounded half to even), so that a load that rounds here holds the same integers.
// int8 per output row: (q int8 [N, K], scale fp32 [N], wsum int32 [N]).
std::tuple<at::Tensor, at::Tensor, at::Tensor> rtn_int8(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && at::isFloatingType(weight.scalar_type()), "rtn_int8: weight must be a float [N, K]");
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1);
  at::Tensor q = at::empty({N, K}, w.options().dtype(at::kChar));
  at::Tensor scale = at::empty({N}, w.options().dtype(at::kFloat));
  at::Tensor wsum = at::empty({N}, w.options().dtype(at::kInt));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, w.scalar_type(), "rtn_int8", [&] {
    const scalar_t* wp = w.data_ptr<scalar_t>();
    int8_t* qp = q.data_ptr<int8_t>();
    float* sp = scale.data_ptr<float>();
    int32_t* ws = wsum.data_ptr<int32_t>();
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
      std::vector<float> row(K);
      for (int64_t n = n0; n < n1; ++n) {
        float amax = 0.0f;
        for (int64_t k = 0; k < K; ++k) {
          row[k] = static_cast<float>(wp[n * K + k]);
          amax = std::max(amax, std::fabs(row[k]));
        }
        const float sc = std::max(amax, 1e-10f) / 127.0f;
        int32_t sum = 0;
        for (int64_t k = 0; k < K; ++k) {
          const float v = std::min(std::max(std::nearbyint(row[k] / sc), -127.0f), 127.0f);
          qp[n * K + k] = static_cast<int8_t>(v);
          sum += static_cast<int32_t>(v);
        }
        sp[n] = sc;
        ws[n] = sum;
      }
    });
  });
  return {q, scale, wsum};
}

// int4 by groups of `group` input columns (the last group may be short): (packed uint8 [N, Kp / 2], scale fp32 [N, G],
// zero fp32 [N, G]); symmetric (zero_point false): zero 8, scale amax / 7.5; asymmetric: min..max (each clamped to
// take in 0) onto 0..15.
std::tuple<at::Tensor, at::Tensor, at::Tensor> rtn_int4(const at::Tensor& weight, int64_t group, bool zero_point) {
  TORCH_CHECK(weight.dim() == 2 && at::isFloatingType(weight.scalar_type()), "rtn_int4: weight must be a float [N, K]");
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(group > 0 && (group % 32 == 0 || group >= K), "rtn_int4: group must be a multiple of 32 or cover K");
  const int64_t G = (K + group - 1) / group, Kp = round_up(K, 32);
  at::Tensor packed = at::empty({N, Kp / 2}, w.options().dtype(at::kByte));  // (every byte written below)
  at::Tensor scale = at::empty({N, G}, w.options().dtype(at::kFloat));
  at::Tensor zero = at::empty({N, G}, w.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, w.scalar_type(), "rtn_int4", [&] {
    const scalar_t* wp = w.data_ptr<scalar_t>();
    uint8_t* pp = packed.data_ptr<uint8_t>();
    float* sp = scale.data_ptr<float>();
    float* zp = zero.data_ptr<float>();
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
      std::vector<uint8_t> q(Kp);
      for (int64_t n = n0; n < n1; ++n) {
        const scalar_t* wr = wp + n * K;
        std::fill(q.begin() + K, q.end(), uint8_t{0});
        for (int64_t g = 0; g < G; ++g) {
          const int64_t k0 = g * group, k1 = std::min(K, k0 + group);
          float sc, z;
          if (zero_point) {
            float lo = 0.0f, hi = 0.0f;  // (a short group's padding is 0, inside the clamps)
            for (int64_t k = k0; k < k1; ++k) {
              lo = std::min(lo, static_cast<float>(wr[k]));
              hi = std::max(hi, static_cast<float>(wr[k]));
            }
            sc = std::max((hi - lo) / 15.0f, 1e-10f);
            z = std::min(std::max(std::nearbyint(-lo / sc), 0.0f), 15.0f);
          } else {
            float amax = 0.0f;
            for (int64_t k = k0; k < k1; ++k) amax = std::max(amax, std::fabs(static_cast<float>(wr[k])));
            sc = std::max(amax, 1e-10f) / 7.5f;
            z = 8.0f;
          }
          for (int64_t k = k0; k < k1; ++k) {
            const float t = static_cast<float>(wr[k]) / sc + z;
            q[k] = static_cast<uint8_t>(std::min(std::max(std::nearbyint(t), 0.0f), 15.0f));
          }
          sp[n * G + g] = sc;
          zp[n * G + g] = z;
        }
        uint8_t* out = pp + n * (Kp / 2);
        for (int64_t k0 = 0; k0 < Kp; k0 += 32)
          for (int j = 0; j < 16; ++j) out[k0 / 2 + j] = static_cast<uint8_t>(q[k0 + j] | (q[k0 + 16 + j] << 4));
      }
    });
  });
  return {packed, scale, zero};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def("has_quantized_linear() -> bool", &has_quantized_linear);
  m.def("dequantize_bf16(Tensor weight, Tensor scale, Tensor zero, int in_features, int group) -> Tensor");
  m.def("rtn_int8(Tensor weight) -> (Tensor, Tensor, Tensor)");
  m.def("rtn_int4(Tensor weight, int group, bool zero_point) -> (Tensor, Tensor, Tensor)");
  m.def("has_weight_only_linear() -> bool", &has_weight_only_linear);
  m.def("int8_linear(Tensor x, Tensor weight, Tensor scale, Tensor wsum, Tensor? bias) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor weight, Tensor scale, Tensor zero, int in_features, int group, "
        "Tensor? bias) -> Tensor");
  m.def("w8a8_linear(Tensor x, Tensor weight, Tensor scale, Tensor wsum, int in_features, Tensor? bias) -> Tensor");
  m.def("quantize_rows_uint8(Tensor x) -> (Tensor, Tensor)");
  m.def("scale_rows(Tensor y, Tensor row_scale, Tensor? bias, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill_cpu, CPU, m) {
  m.impl("dequantize_bf16", &dequantize_bf16);
  m.impl("rtn_int8", &rtn_int8);
  m.impl("rtn_int4", &rtn_int4);
  m.impl("int8_linear", &int8_linear);
  m.impl("int4_linear", &int4_linear);
  m.impl("w8a8_linear", &w8a8_linear);
  m.impl("quantize_rows_uint8", &quantize_rows_uint8);
  m.impl("scale_rows", &scale_rows);
}
