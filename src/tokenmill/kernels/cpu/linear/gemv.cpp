// bf16 matrix products straight from the weight oneDNN packed for PackedLinear, so each weight is
// kept once. fp32 accumulation, fp32 bias, bf16 output rounded to nearest even: the numbers of
// oneDNN's path up to summation order.
// - 1 to 4 rows (decode at small batch): bound by reading the weight; this loop streams it with fewer
//   instructions per byte than oneDNN's general kernel, so it reads the weight faster.
// - More rows: the same inner loop over tiles of 6 rows, each 64-output block of the weight read from
//   L2 by every tile, while software prefetches bring the next block into L2 (oneDNN leaves that to
//   the hardware prefetcher), which outruns oneDNN's kernel from 64 rows up with the weights cold in
//   cache as in a model's step (tools/linear_bench.py; bench/README.md, 'Measurements behind the code').
//   The weight block must fit in L2 beside the prefetched next one, so for K over kTiledMaxK (the 1.1B
//   model's down projection) oneDNN keeps more than 4 rows.
// - Where this process may run AMX-BF16 (tokenmill::amx_bf16_permitted), oneDNN's AMX kernels outrun both loops
//   from a few rows up (4 rows: 1.2-1.5x faster; 64 rows: 9-13x, on an AMX Xeon). There this kernel takes 1 to
//   kAmxRows rows (two tiles' 32) with AMX tiles of its own instead (amx_blocks: tiles of x's rows against the
//   packed weight read in place, so that the weight is read once for all of them without oneDNN's per-call
//   work, which is most of a small product's time when the weight sits in cache; at 1-2 rows it also reads
//   the weight faster than the row loop), and leaves more rows to oneDNN.
//
// The packed layout is oneDNN's AB16b64a2b for a weight [N, K]: blocks of 64 outputs, each
// holding all of K as chunks of 32 k, a chunk being 16 k-pairs x 64 outputs x 2; N is padded to
// 64 and K to 32, with zeros. Nothing in oneDNN promises that layout, so PackedLinear checks it
// against F.linear once before it uses this kernel (tokenmill.layers.linear).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "kernels.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

namespace {

constexpr int64_t kBlockN = tokenmill::kPackedBlockN, kBlockK = tokenmill::kPackedBlockK;
constexpr int64_t kGemvRows = 4;     // up to this many rows: gemv_blocks, no software prefetch
constexpr int64_t kAmxRows = 32;     // with AMX-BF16 usable, the most rows this kernel takes (amx_blocks): two tiles'
constexpr int64_t kTileRows = 6;     // the tiled path's rows per tile (24 accumulators, 4 weight registers)
constexpr int64_t kTiledMaxK = 2048; // the tiled path's largest padded K: a 256 KiB weight block
constexpr int64_t kChunkBytes = 256 << 10;  // the tiled path's rows of x at a time (for a 1 MiB L2, Zen 5's)

constexpr int64_t padded(int64_t n, int64_t block) { return (n + block - 1) / block * block; }

// the packed weight's buffer, checked to have the layout's size
const uint16_t* packed_data(const at::Tensor& w, int64_t expected_bytes) {
  const auto [data, bytes] = tokenmill::onednn_buffer(w);
  TORCH_CHECK(bytes == expected_bytes, "packed_gemv: the packed weight has ", bytes,
              " bytes, the AB16b64a2b layout needs ", expected_bytes);
  return static_cast<const uint16_t*>(data);
}

// one block of 64 outputs over all of K (Kp, a multiple of 32) for M rows of x. The block is one
// contiguous run of memory, and at 1-4 rows the hardware prefetcher alone streams it fastest: software
// prefetches a few KiB ahead (into L1 or L2) were slower at one row and no faster at four (bench/README.md,
// 'Measurements behind the code').
// The tiled path passes pf: one line of the next block is prefetched into L2 every 2^pf_shift k-pairs.
template <int M, bool PREFETCH = false>
inline void block_dot(const uint16_t* w, const uint16_t* x, int64_t ldx, int64_t Kp, __m512 acc[M][4],
                      const char* pf = nullptr, int pf_shift = 0) {
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < Kp / 2; ++p) {
    const uint16_t* wp = w + p * 2 * kBlockN;
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wp + 32);
    const __m512bh w2 = (__m512bh)_mm512_loadu_si512(wp + 64);
    const __m512bh w3 = (__m512bh)_mm512_loadu_si512(wp + 96);
    if (PREFETCH && pf != nullptr && (p & ((int64_t{1} << pf_shift) - 1)) == 0)
      _mm_prefetch(pf + (p >> pf_shift) * 64, _MM_HINT_T1);
    for (int m = 0; m < M; ++m) {
      uint32_t pair;  // x[m, 2p], x[m, 2p + 1]
      std::memcpy(&pair, x + m * ldx + 2 * p, sizeof(pair));
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], w0, xb);
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], w1, xb);
      acc[m][2] = _mm512_dpbf16_ps(acc[m][2], w2, xb);
      acc[m][3] = _mm512_dpbf16_ps(acc[m][3], w3, xb);
    }
  }
}

// acc(m, j) (outputs n0 + 16 j .. + 15 of row m) + bias -> y rows (ldy apart) of outputs n0 .. n0 + 63 that are
// below N, rounded once to bf16
template <typename Acc>
inline void store_rows(int64_t rows, Acc acc, const uint16_t* bias, uint16_t* y, int64_t ldy, int64_t n0, int64_t N) {
  for (int j = 0; j < 4; ++j) {
    const int64_t n = n0 + 16 * j;
    if (n >= N) break;
    const __mmask16 mask = static_cast<__mmask16>((1u << std::min<int64_t>(16, N - n)) - 1);
    // bf16 -> fp32 is a 16-bit shift
    const __m512 b = bias == nullptr ? _mm512_setzero_ps()
                         : _mm512_castsi512_ps(_mm512_slli_epi32(
                               _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, bias + n)), 16));
    for (int64_t m = 0; m < rows; ++m) {
      const __m256i out = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc(m, j), b));
      _mm256_mask_storeu_epi16(y + m * ldy + n, mask, out);
    }
  }
}

template <int M>
inline void store_block(__m512 acc[M][4], const uint16_t* bias, uint16_t* y, int64_t ldy, int64_t n0, int64_t N) {
  store_rows(M, [&](int64_t m, int j) { return acc[m][j]; }, bias, y, ldy, n0, N);
}

template <int M>
void gemv_blocks(const uint16_t* w, const uint16_t* x, int64_t ldx, int64_t Kp, int64_t N, const uint16_t* bias,
                 uint16_t* y, int64_t nb0, int64_t nb1) {
  for (int64_t nb = nb0; nb < nb1; ++nb) {
    __m512 acc[M][4];
    block_dot<M>(w + nb * kBlockN * Kp, x, ldx, Kp, acc);
    store_block<M>(acc, bias, y, N, nb * kBlockN, N);
  }
}

template <int R>
inline void tile(const uint16_t* w, const uint16_t* x, int64_t ldx, int64_t Kp, int64_t N, const uint16_t* bias,
                 uint16_t* y, int64_t n0, const char* pf, int pf_shift) {
  __m512 acc[R][4];
  block_dot<R, true>(w, x, ldx, Kp, acc, pf, pf_shift);
  store_block<R>(acc, bias, y, N, n0, N);
}

// Rows [m0, m1) of the block of 64 outputs at wb (outputs n0..), in tiles of kTileRows rows, each
// reading the block from L2; kTileRows + 1 rows left at the end are one tile (28 accumulators, x's pairs
// broadcast from memory), not a full tile and a tile of one row that reads the whole block again. The 2 * Kp
// lines at next (the block this thread takes on next, or null) are prefetched one every 2^pf_shift k-pairs, over
// about the first half of the tiles, so that they arrive while this block is worked on.
void gemm_rows(const uint16_t* wb, const uint16_t* x, int64_t ldx, int64_t Kp, int64_t m0, int64_t m1, int64_t N,
               const uint16_t* bias, uint16_t* y, int64_t n0, const char* next) {
  const int64_t pairs = Kp / 2, lines = 2 * Kp, tiles = (m1 - m0 + kTileRows - 1) / kTileRows;
  int pf_shift = 0;
  while ((lines * 2 << pf_shift) <= tiles * pairs) ++pf_shift;
  int64_t prefetched = 0;  // lines of the next block asked for so far
  for (int64_t m = m0, rows = 0; m < m1; m += rows) {
    rows = m1 - m == kTileRows + 1 ? kTileRows + 1 : std::min(kTileRows, m1 - m);
    const char* pf = next != nullptr && prefetched < lines ? next + prefetched * 64 : nullptr;
    const uint16_t* xt = x + m * ldx;
    uint16_t* yt = y + m * N;
    switch (rows) {
      case 1: tile<1>(wb, xt, ldx, Kp, N, bias, yt, n0, pf, pf_shift); break;
      case 2: tile<2>(wb, xt, ldx, Kp, N, bias, yt, n0, pf, pf_shift); break;
      case 3: tile<3>(wb, xt, ldx, Kp, N, bias, yt, n0, pf, pf_shift); break;
      case 4: tile<4>(wb, xt, ldx, Kp, N, bias, yt, n0, pf, pf_shift); break;
      case 5: tile<5>(wb, xt, ldx, Kp, N, bias, yt, n0, pf, pf_shift); break;
      case kTileRows + 1: tile<kTileRows + 1>(wb, xt, ldx, Kp, N, bias, yt, n0, pf, pf_shift); break;
      default: tile<kTileRows>(wb, xt, ldx, Kp, N, bias, yt, n0, pf, pf_shift); break;
    }
    prefetched += pairs >> pf_shift;
  }
}

// M > kGemvRows rows. Work items are (row chunk, block) pairs, chunk-major: a chunk's rows of x stay
// in L2 while the blocks pass (re-reading x from L3 for every block left it behind oneDNN),
// and chunks are cut finer where the blocks alone would leave threads idle (fewer than 4 items per
// thread: the 100M model's 12-block projections on more than 3 threads).
void gemm(const uint16_t* w, const uint16_t* x, int64_t ldx, int64_t Kp, int64_t M, int64_t N, const uint16_t* bias,
          uint16_t* y) {
  const int64_t blocks = padded(N, kBlockN) / kBlockN, tiles = (M + kTileRows - 1) / kTileRows;
  const int64_t threads = at::get_num_threads();
  const int64_t fit = std::max<int64_t>(1, kChunkBytes / (Kp * 2 * kTileRows));  // tiles of x per chunk
  // as many chunks as x needs to fit, or as idle threads need, but no more than there are tiles
  const int64_t wanted = std::min(tiles, std::max((tiles + fit - 1) / fit, (4 * threads + blocks - 1) / blocks));
  const int64_t chunk_rows = (tiles + wanted - 1) / wanted * kTileRows;
  const int64_t chunks = (M + chunk_rows - 1) / chunk_rows;
  at::parallel_for(0, chunks * blocks, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t chunk = i / blocks, nb = i % blocks;
      const uint16_t* wb = w + nb * kBlockN * Kp;
      // the block of this thread's next item (the first again after the last)
      const char* next = i + 1 < i1 ? reinterpret_cast<const char*>(w + ((i + 1) % blocks) * kBlockN * Kp) : nullptr;
      gemm_rows(wb, x, ldx, Kp, chunk * chunk_rows, std::min(M, (chunk + 1) * chunk_rows), N, bias, y, nb * kBlockN,
                next);
    }
  });
}

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
#define TOKENMILL_GEMV_AMX 1

// M (<= kAmxRows) rows of x times blocks [nb0, nb1) of 64 outputs, with AMX-BF16 tiles, in the calling
// thread (each thread configures its own tiles). Per chunk of 32 k, x's rows' 32-k slice is an A tile (16
// rows at most); the chunk's 16 k-pairs of each 16 outputs are 64 bytes 256 apart in AB16b64a2b, so
// tileloadd reads them as a B tile in place; each A tile times each B tile accumulates into a float32 C
// tile. Up to 16 rows: one A tile (4), B tiles 5-7 in turn, the four 16-output columns in C tiles 0-3.
// 17-32 rows: two A tiles (4, 5) over two B tiles (6, 7) into C tiles 0-3, the block's 64 outputs in two
// passes of 32 (every weight byte still read once: the second pass finds the block in L2). Per output:
// fp32 sums of the pairs' exact products, then the bias, rounded once to bf16 (as block_dot).
void amx_blocks(const uint16_t* w, const uint16_t* x, int64_t ldx, int64_t Kp, int64_t M, int64_t N,
                const uint16_t* bias, uint16_t* y, int64_t nb0, int64_t nb1) {
  const bool two = M > 16;
  const uint8_t top = two ? 16 : static_cast<uint8_t>(M), rest = static_cast<uint8_t>(M - 16);
  tokenmill::AmxTileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
  if (two) {
    cfg.rows[2] = cfg.rows[3] = cfg.rows[5] = rest;
  } else {
    for (int t = 0; t < 5; ++t) cfg.rows[t] = top;
  }
  _tile_loadconfig(&cfg);
  alignas(64) float out[kAmxRows * kBlockN];  // row m: the block's 64 sums
  const int64_t xstride = ldx * 2, chunks = Kp / kBlockK;
  const uint16_t* x2 = two ? x + 16 * ldx : x;  // rows 16.. (two tiles only)
  for (int64_t nb = nb0; nb < nb1; ++nb) {
    const uint16_t* wb = w + nb * kBlockN * Kp;
    if (!two) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t c = 0; c < chunks; ++c) {
        const uint16_t* wc = wb + c * kBlockK * kBlockN;
        _tile_loadd(4, x + c * kBlockK, xstride);
        _tile_loadd(5, wc, 256);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(6, wc + 32, 256);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(7, wc + 64, 256);
        _tile_dpbf16ps(2, 4, 7);
        _tile_loadd(5, wc + 96, 256);
        _tile_dpbf16ps(3, 4, 5);
      }
      _tile_stored(0, out, kBlockN * 4);
      _tile_stored(1, out + 16, kBlockN * 4);
      _tile_stored(2, out + 32, kBlockN * 4);
      _tile_stored(3, out + 48, kBlockN * 4);
    } else {
      for (int half = 0; half < 2; ++half) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t c = 0; c < chunks; ++c) {
          const uint16_t* wc = wb + c * kBlockK * kBlockN + 64 * half;
          _tile_loadd(4, x + c * kBlockK, xstride);
          _tile_loadd(5, x2 + c * kBlockK, xstride);
          _tile_loadd(6, wc, 256);
          _tile_loadd(7, wc + 32, 256);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
        float* o = out + 32 * half;
        _tile_stored(0, o, kBlockN * 4);
        _tile_stored(1, o + 16, kBlockN * 4);
        _tile_stored(2, o + 16 * kBlockN, kBlockN * 4);
        _tile_stored(3, o + 16 * kBlockN + 16, kBlockN * 4);
      }
    }
    store_rows(M, [&](int64_t m, int j) { return _mm512_load_ps(out + m * kBlockN + 16 * j); }, bias, y, N,
               nb * kBlockN, N);
  }
  _tile_release();
}
#endif

// x [M, K] bf16, weight packed by mkldnn::_reorder_linear_weight for a [N, K] weight,
// bias [N] bf16 or none -> [M, N] bf16
at::Tensor packed_gemv(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(weight.dim() == 2 && x.dim() == 2 && weight.size(1) == x.size(1),
              "packed_gemv: weight and x disagree on K");
  TORCH_CHECK(weight.is_mkldnn(), "packed_gemv: the weight must be packed by mkldnn::_reorder_linear_weight");
  const int64_t N = weight.size(0);
  return tokenmill::packed_gemv_at(packed_data(weight, tokenmill::packed_gemv_bytes(N, x.size(1))), x, N, bias);
}

bool has_packed_gemv() { return true; }

}  // namespace

int64_t tokenmill::packed_gemv_bytes(int64_t N, int64_t K) { return padded(N, kBlockN) * padded(K, kBlockK) * 2; }

int64_t tokenmill::packed_gemv_max_rows(int64_t K) {
#ifdef TOKENMILL_GEMV_AMX
  if (tokenmill::amx_bf16_permitted()) return kAmxRows;
#else
  // built without AMX (a compiler that lacks it): the row loop keeps the 1-2 rows it reads faster than oneDNN
  if (tokenmill::amx_bf16_permitted()) return 2;
#endif
  return padded(K, kBlockK) <= kTiledMaxK ? std::numeric_limits<int64_t>::max() : kGemvRows;
}

at::Tensor tokenmill::packed_gemv_at(const uint16_t* w, const at::Tensor& x, int64_t N,
                                     const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.is_contiguous(),
              "packed_gemv: x must be a contiguous 2-D bfloat16 tensor");
  const int64_t M = x.size(0), K = x.size(1);
  const uint16_t* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == N,
                "packed_gemv: bias must be a contiguous bfloat16 [N]");
    bp = reinterpret_cast<const uint16_t*>(bias->data_ptr<at::BFloat16>());
  }
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const int64_t Np = padded(N, kBlockN), Kp = padded(K, kBlockK);
  // the weight's K padding is zero; x's must be too (not garbage that could be NaN)
  std::vector<uint16_t> xpad;
  int64_t ldx = K;
  if (Kp != K) {
    xpad.assign(M * Kp, 0);
    for (int64_t m = 0; m < M; ++m) std::memcpy(xpad.data() + m * Kp, xp + m * K, K * sizeof(uint16_t));
    xp = xpad.data();
    ldx = Kp;
  }
#ifdef TOKENMILL_GEMV_AMX
  if (M <= kAmxRows && tokenmill::amx_bf16_permitted()) {
    at::parallel_for(0, Np / kBlockN, 1, [&](int64_t nb0, int64_t nb1) {
      amx_blocks(w, xp, ldx, Kp, M, N, bp, yp, nb0, nb1);
    });
    return y;
  }
#endif
  if (M > kGemvRows) {
    gemm(w, xp, ldx, Kp, M, N, bp, yp);
    return y;
  }
  at::parallel_for(0, Np / kBlockN, 1, [&](int64_t nb0, int64_t nb1) {
    switch (M) {
      case 1: gemv_blocks<1>(w, xp, ldx, Kp, N, bp, yp, nb0, nb1); break;
      case 2: gemv_blocks<2>(w, xp, ldx, Kp, N, bp, yp, nb0, nb1); break;
      case 3: gemv_blocks<3>(w, xp, ldx, Kp, N, bp, yp, nb0, nb1); break;
      default: gemv_blocks<4>(w, xp, ldx, Kp, N, bp, yp, nb0, nb1); break;
    }
  });
  return y;
}

#else  // no AVX-512 BF16: callers keep oneDNN's kernel

namespace {

at::Tensor packed_gemv(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&) {
  TORCH_CHECK(false, "packed_gemv: built without AVX512-BF16");
}

bool has_packed_gemv() { return false; }

}  // namespace

int64_t tokenmill::packed_gemv_bytes(int64_t, int64_t) { TORCH_CHECK(false, "built without AVX512-BF16"); }

int64_t tokenmill::packed_gemv_max_rows(int64_t) { return 0; }

at::Tensor tokenmill::packed_gemv_at(const uint16_t*, const at::Tensor&, int64_t, const c10::optional<at::Tensor>&) {
  TORCH_CHECK(false, "packed_gemv: built without AVX512-BF16");
}

#endif

int64_t tokenmill::onednn_rows(int64_t m) {
  if (m <= 16) return m;
  int64_t top = 1;  // the largest power of two below m
  while (2 * top < m) top *= 2;
  const int64_t step = top / 8;
  return (m + step - 1) / step * step;
}

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def("onednn_rows(int rows) -> int", &tokenmill::onednn_rows);
  m.def("has_packed_gemv() -> bool", &has_packed_gemv);
  m.def("packed_gemv_max_rows(int in_features) -> int", &tokenmill::packed_gemv_max_rows);
  m.def("gemv_sees_amx_bf16() -> bool", &tokenmill::amx_bf16_permitted);  // whether AMX-BF16 is usable here
  m.def("packed_gemv(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
}

// the packed weight is an opaque oneDNN tensor, so calls dispatch on MkldnnCPU
TORCH_LIBRARY_IMPL(tokenmill_cpu, CPU, m) { m.impl("packed_gemv", &packed_gemv); }
TORCH_LIBRARY_IMPL(tokenmill_cpu, MkldnnCPU, m) { m.impl("packed_gemv", &packed_gemv); }
