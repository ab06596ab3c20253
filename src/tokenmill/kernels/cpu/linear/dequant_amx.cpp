// int8 / int4 weights (quantized.cpp's layouts) against more bf16 rows of x than the limb kernels take, with
// AMX-BF16 tiles and no bf16 copy of the whole weight. The outputs are taken 32 at a time. Each block's weight is
// dequantized into one of two per-thread buffers: the reference's values (q * scale or (q - zero) * scale in fp32,
// rounded to nearest even, as dequantize_bf16 makes them; K's padding zero), in the B-tile order tdpbf16ps reads
// (per 32 k, 16 k-pairs of 16 outputs: a 16 x 16 transpose of the rows' pairs). Every 32 rows of x (A tiles, read
// in place, or from a zero-padded copy where needed) are multiplied by it into four float32 C tiles, while the
// vector units dequantize the next block into the other buffer. Per output: fp32 sums of the pairs' products, plus
// the bias, rounded once to bf16. Where x's rows would not stay in L2 (over kSliceBytes), K is taken in slices,
// each thread's blocks all passing over one slice before the next, their C tiles kept in fp32 between slices. A
// buffer holds 32 outputs of a slice in bf16 (64 KiB at 1024 k), so each weight byte is read from memory once and
// dequantized once per call.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels.h"

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define TOKENMILL_DEQUANT_AMX 1
#include <immintrin.h>

#include "avx512.h"
#endif

namespace {

#ifdef TOKENMILL_DEQUANT_AMX

constexpr int64_t kOut = 32;    // outputs a block: two B tiles of 16
constexpr int64_t kChunk = 32;  // k a tile row of bf16 pairs
constexpr int64_t kTile = 16 * kChunk;  // bf16 values in one tile (16 rows x 64 bytes)
// the most bytes of x's rows one slice of k takes: each thread's blocks pass over a slice while it stays in L2
constexpr int64_t kSliceBytes = 1 << 20;

int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// C tile T at the start of a slice: zero on the first, else the sums of the slices before (rows kOut floats apart).
// A macro: the tile intrinsics take the tile's number as a literal.
#define TM_BEGIN_SUMS(T, first_slice, before)   \
  do {                                           \
    if (first_slice) _tile_zero(T);              \
    else _tile_loadd(T, (before), kOut * 4);     \
  } while (0)

// output n's 32 k from k0 as bf16 (zero past K): 16 dwords of k-pairs
inline __m512i dequant_chunk(const tokenmill::QuantWeight& q, int64_t n, int64_t k0) {
  const int64_t left = q.K - k0;
  __m512 lo, hi;
  if (q.w8) {
    const __mmask32 mk = left >= 32 ? 0xFFFFFFFFu : static_cast<__mmask32>((1ull << left) - 1);
    const __m256i b = _mm256_maskz_loadu_epi8(mk, q.w8 + n * q.K + k0);
    const __m512 sc = _mm512_set1_ps(q.scale[n]);
    lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(b))), sc);
    hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1))), sc);
  } else {
    // a run of 32 k: byte j holds k0 + j in its low nibble and k0 + 16 + j in its high one
    const int64_t g = n * q.groups + k0 / q.group;
    const __m512 sc = _mm512_set1_ps(q.scale[g]), z = _mm512_set1_ps(q.zero ? q.zero[g] : 8.0f);
    const auto* run = reinterpret_cast<const __m128i*>(q.w4 + n * (q.Kp / 2) + k0 / 2);
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(run));
    const __m512 low = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(0xF)));
    const __m512 high = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
    lo = _mm512_maskz_mul_ps(tokenmill::first_lanes(left), _mm512_sub_ps(low, z), sc);
    hi = _mm512_maskz_mul_ps(tokenmill::first_lanes(left - 16), _mm512_sub_ps(high, z), sc);
  }
  return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));  // k0..k0+15 low, k0+16.. high
}

// One B tile of outputs n0..n0+31 (zero past N) over a slice of k from k0: unit u = h * chunks + c is outputs
// n0 + 16h.. over the slice's chunk c, at buf + u * kTile as [16 k-pairs][16 outputs][2] (the block's slice:
// buf [2][chunks][...])
void dequant_unit(const tokenmill::QuantWeight& q, int64_t n0, int64_t k0, int64_t chunks, int64_t u, uint16_t* buf) {
  const int64_t h = u / chunks, c = u % chunks;
  __m512i r[16];
  for (int i = 0; i < 16; ++i) {
    const int64_t n = n0 + 16 * h + i;
    r[i] = n < q.N ? dequant_chunk(q, n, k0 + c * kChunk) : _mm512_setzero_si512();
  }
  tokenmill::transpose16x16(r);
  uint16_t* t = buf + u * kTile;
  for (int i = 0; i < 16; ++i) _mm512_store_si512(t + 32 * i, r[i]);
}

#endif

}  // namespace

bool tokenmill::dequant_amx_available() {
#ifdef TOKENMILL_DEQUANT_AMX
  return tokenmill::amx_bf16_permitted();
#else
  return false;
#endif
}

at::Tensor tokenmill::dequant_amx_linear(const at::Tensor& x, const QuantWeight& q,
                                         const c10::optional<at::Tensor>& bias) {
#ifdef TOKENMILL_DEQUANT_AMX
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.size(1) == q.K && x.stride(1) == 1,
              "dequant_amx_linear: x must be bf16 [M, ", q.K, "] with contiguous rows");
  const int64_t M = x.size(0), N = q.N, Kp = q.Kp, Mp = round_up(M, 16);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  // the A tiles read whole 16-row, 32-k blocks of x: in place where K is a multiple of 32 (all but a last partial
  // block of rows), else from a zero-padded copy, as are the rows of a partial block ([M_in, Mp) in pad)
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const int64_t ldx = x.stride(0), M_in = q.K == Kp ? M / 16 * 16 : 0;
  std::vector<uint16_t> pad((Mp - M_in) * Kp, 0);
  for (int64_t m = M_in; m < M; ++m) std::memcpy(pad.data() + (m - M_in) * Kp, xp + m * ldx, q.K * sizeof(uint16_t));
  auto rows_at = [&](int64_t m) { return m < M_in ? xp + m * ldx : pad.data() + (m - M_in) * Kp; };
  auto stride_at = [&](int64_t m) { return (m < M_in ? ldx : Kp) * 2; };
  const bool has_bias = bias.has_value() && bias->defined();
  const at::Tensor b = has_bias ? bias->to(at::kFloat).contiguous() : at::Tensor();
  TORCH_CHECK(!has_bias || b.numel() == N, "dequant_amx_linear: bias must have ", N, " values");
  const float* bp = has_bias ? b.data_ptr<float>() : nullptr;
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const int64_t blocks = (N + kOut - 1) / kOut;
  // K in slices of kc (a multiple of 32) where Mp rows of all of K would not stay in L2: every block of a thread
  // passes over one slice before the next, its C tiles kept between slices in fp32 (acc)
  const int64_t kc = std::min(Kp, std::max<int64_t>(kChunk, kSliceBytes / (Mp * 2) / kChunk * kChunk));
  const int64_t slices = (Kp + kc - 1) / kc;
  at::parallel_for(0, blocks, 1, [&](int64_t nb0, int64_t nb1) {
    tokenmill::AmxTileConfig cfg;
    for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
    _tile_loadconfig(&cfg);
    // two block buffers: while the tiles multiply one block, the vector units dequantize the next into the other,
    // spread evenly over the block's chunk steps, so the two kinds of work overlap
    const int64_t max_units = 2 * (kc / kChunk);
    auto* bufs = static_cast<uint16_t*>(std::aligned_alloc(64, 2 * max_units * kTile * sizeof(uint16_t)));
    std::vector<float> acc(slices > 1 ? (nb1 - nb0) * Mp * kOut : 0);  // per block: [Mp][32]
    alignas(64) float out[32 * kOut];  // 32 rows of x by the block's 32 outputs
    for (int64_t sl = 0; sl < slices; ++sl) {
      const int64_t k0 = sl * kc, chunks = std::min(kc, Kp - k0) / kChunk, units = 2 * chunks;
      const bool first_slice = sl == 0, last_slice = sl + 1 == slices;
      const int64_t steps = (Mp + 31) / 32 * chunks;
      for (int64_t u = 0; u < units; ++u) dequant_unit(q, nb0 * kOut, k0, chunks, u, bufs);
      for (int64_t nb = nb0; nb < nb1; ++nb) {
        const int64_t n0 = nb * kOut, nn = std::min(kOut, N - n0);
        uint16_t* cur = bufs + ((nb - nb0) % 2) * max_units * kTile;
        uint16_t* next = bufs + ((nb - nb0 + 1) % 2) * max_units * kTile;
        const bool ahead = nb + 1 < nb1;
        int64_t done = 0, step = 0;  // units of the next block dequantized, chunk steps taken
        const uint16_t* b0 = cur;
        const uint16_t* b1 = cur + chunks * kTile;
        float* ab = slices > 1 ? acc.data() + (nb - nb0) * Mp * kOut : nullptr;  // this block's sums in acc
        // the next block's units, spread evenly over this block's chunk steps
        auto overlap = [&] {
          for (++step; ahead && done * steps < step * units; ++done) dequant_unit(q, n0 + kOut, k0, chunks, done, next);
        };
        for (int64_t m = 0; m < Mp; m += 32) {
          const bool two = m + 16 < Mp;
          const uint16_t* x0 = rows_at(m) + k0;
          const int64_t s0 = stride_at(m);
          // these rows' sums: from acc before this slice; into out after the last one, else back into acc (both
          // [rows][kOut])
          float* before = ab ? ab + m * kOut : out;  // (not read on the first slice)
          float* sums = last_slice ? out : before;
          TM_BEGIN_SUMS(0, first_slice, before);
          TM_BEGIN_SUMS(1, first_slice, before + 16);
          if (two) {
            const uint16_t* x1 = rows_at(m + 16) + k0;
            const int64_t s1 = stride_at(m + 16);
            TM_BEGIN_SUMS(2, first_slice, before + 16 * kOut);
            TM_BEGIN_SUMS(3, first_slice, before + 16 * kOut + 16);
            for (int64_t c = 0; c < chunks; ++c) {
              _tile_loadd(4, x0 + c * kChunk, s0);
              _tile_loadd(5, x1 + c * kChunk, s1);
              _tile_loadd(6, b0 + c * kTile, 64);
              _tile_loadd(7, b1 + c * kTile, 64);
              _tile_dpbf16ps(0, 4, 6);
              _tile_dpbf16ps(1, 4, 7);
              _tile_dpbf16ps(2, 5, 6);
              _tile_dpbf16ps(3, 5, 7);
              overlap();
            }
            _tile_stored(2, sums + 16 * kOut, kOut * 4);
            _tile_stored(3, sums + 16 * kOut + 16, kOut * 4);
          } else {
            for (int64_t c = 0; c < chunks; ++c) {
              _tile_loadd(4, x0 + c * kChunk, s0);
              _tile_loadd(6, b0 + c * kTile, 64);
              _tile_loadd(7, b1 + c * kTile, 64);
              _tile_dpbf16ps(0, 4, 6);
              _tile_dpbf16ps(1, 4, 7);
              overlap();
            }
          }
          _tile_stored(0, sums, kOut * 4);
          _tile_stored(1, sums + 16, kOut * 4);
          if (!last_slice) continue;
          const __mmask16 k0m = tokenmill::first_lanes(nn), k1m = tokenmill::first_lanes(nn - 16);
          const __m512 bias0 = bp ? _mm512_maskz_loadu_ps(k0m, bp + n0) : _mm512_setzero_ps();
          const __m512 bias1 = bp ? _mm512_maskz_loadu_ps(k1m, bp + n0 + 16) : _mm512_setzero_ps();
          for (int64_t i = 0, rows = std::min<int64_t>(32, M - m); i < rows; ++i) {
            uint16_t* yr = yp + (m + i) * N + n0;
            const __m512 v0 = _mm512_add_ps(_mm512_load_ps(out + i * kOut), bias0);
            const __m512 v1 = _mm512_add_ps(_mm512_load_ps(out + i * kOut + 16), bias1);
            _mm256_mask_storeu_epi16(yr, k0m, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v0)));
            if (nn > 16) _mm256_mask_storeu_epi16(yr + 16, k1m, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v1)));
          }
        }
        for (; ahead && done < units; ++done) dequant_unit(q, n0 + kOut, k0, chunks, done, next);
      }
    }
    std::free(bufs);
    _tile_release();
  });
#undef TM_BEGIN_SUMS
  return y;
#else
  (void)x;
  (void)q;
  (void)bias;
  TORCH_CHECK(false, "dequant_amx_linear: built without AMX-BF16");
#endif
}

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  // whether int8_linear / int4_linear take bf16 batches of any size (dequant_amx_linear beyond 16 rows)
  m.def("has_dequant_amx() -> bool", &tokenmill::dequant_amx_available);
}
