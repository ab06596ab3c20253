// Paged prefill attention for CPUs with AVX512-BF16: every prefill chunk of a step attends its query
// rows to its context read in place from the paged KV cache; causal, optional sliding window, GQA
// without repeating K/V. Flash-style: a work item is a tile of TR query rows (positions x the query
// heads of one kv head's group) against the context in chunks of KC keys, online softmax in fp32.
//
// Layout choices, for vdpbf16ps (pairs of bf16 products summed into fp32 lanes):
// - scores are computed transposed, lanes = query rows: the tile's Q is packed once as
//   qp[d pair][row], each K pair is broadcast straight from the cache, so no K packing, and the
//   softmax max/sum are lane-wise (no horizontal reductions);
// - PV has lanes = head dim: V is packed per chunk as vp[key pair][d] (the two keys of a pair
//   interleaved), P as pp[key pair][row] bf16 pairs, broadcast per row.
// Where AMX-BF16 runs (checked at run time), the same tile's two products run on AMX tiles over the same
// packed operands (scores_amx, pv_amx): qp and pp are already the B tiles tdpbf16ps reads.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

#include "avx512.h"
#define TOKENMILL_PREFILL_DPBF16 1
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
#define TOKENMILL_PREFILL_AMX 1
#endif
#endif

#include "kernels.h"

namespace {

#ifdef TOKENMILL_PREFILL_DPBF16

constexpr int TR = 48;            // query rows per tile: 3 vectors of 16 lanes
constexpr int RV = TR / 16;
constexpr int KC = 32;            // keys per chunk
constexpr int KG = 8;             // keys per scores micro-kernel call
constexpr float kMasked = -1e30f; // finite, so exp2 never sees inf - inf
constexpr float kLog2e = 1.4426950408889634f;

struct Problem {
  const uint16_t* q;
  const uint16_t* kc;
  const uint16_t* vc;
  uint16_t* out;
  const int32_t* qsl;     // [P + 1] row offsets of the prefill chunks in q / out
  const int32_t* lens;    // [P] context length of each chunk's sequence
  const int32_t* tables;  // [P, max_blocks]
  int64_t max_blocks, hq, hk, bs;
  int64_t q_stride;       // elements between q's rows (q may be a split of a fused qkv projection)
  float c;                // softmax scale * log2(e): scores live in the log2 domain
  int64_t window;
};

struct Item {
  int32_t seq, head, tile;
  int64_t cost;
};

template <int D>
struct Workspace {
  alignas(64) uint32_t qp[D / 2][TR];
  alignas(64) float s[KC][TR];
  alignas(64) uint32_t pp[KC / 2][TR];
  alignas(64) uint32_t vp[KC / 2][D];
  alignas(64) float o[TR][D];
  alignas(64) float corr[TR];
  alignas(64) float l[TR];
  alignas(64) int32_t qpos[TR];
  alignas(64) int32_t lo[TR];  // keys at or below lo are outside the window
  const uint16_t* kptr[KC];
  const uint16_t* vptr[KC];
#ifdef TOKENMILL_PREFILL_AMX
  alignas(64) uint16_t kbuf[KC][D];  // the chunk's K rows, gathered: the A tiles of the scores
  alignas(64) float ot[D][TR];       // the running output, transposed: rescaled lane-wise by row
  alignas(64) uint32_t vt[16][16];   // one A tile of PV: 16 d of V^T over 16 key pairs
#endif
};

inline uint32_t load_pair(const uint16_t* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// 2^t for t <= 0 (finite): 2^n * p(f), n = round(t), |f| <= 1/2; degree-5 Taylor, rel. error ~2e-6,
// far below the bf16 rounding P gets before the PV product.
inline __m512 exp2_neg(__m512 t) {
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.3333558e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// s[j][row] = c * q_row . k_j for KG keys at kp[0..KG), all TR rows.
template <int D>
inline void scores(Workspace<D>& ws, const uint16_t* const* kp, float (*s)[TR], float c) {
  __m512 acc[KG][RV];
#pragma GCC unroll 8
  for (int j = 0; j < KG; ++j)
#pragma GCC unroll 3
    for (int r = 0; r < RV; ++r) acc[j][r] = _mm512_setzero_ps();
  for (int p = 0; p < D / 2; ++p) {
    __m512bh qv[RV];
#pragma GCC unroll 3
    for (int r = 0; r < RV; ++r) qv[r] = (__m512bh)_mm512_load_si512(&ws.qp[p][16 * r]);
#pragma GCC unroll 8
    for (int j = 0; j < KG; ++j) {
      const __m512bh kb = (__m512bh)_mm512_set1_epi32(static_cast<int>(load_pair(kp[j] + 2 * p)));
#pragma GCC unroll 3
      for (int r = 0; r < RV; ++r) acc[j][r] = _mm512_dpbf16_ps(acc[j][r], kb, qv[r]);
    }
  }
  const __m512 cv = _mm512_set1_ps(c);
#pragma GCC unroll 8
  for (int j = 0; j < KG; ++j)
#pragma GCC unroll 3
    for (int r = 0; r < RV; ++r) _mm512_store_ps(&s[j][16 * r], _mm512_mul_ps(acc[j][r], cv));
}

// Masks keys c0 + j outside [lo + 1, qpos] of each row.
template <int D>
inline void mask_chunk(Workspace<D>& ws, int64_t c0, int nk) {
  const __m512 neg = _mm512_set1_ps(kMasked);
  for (int r = 0; r < RV; ++r) {
    const __m512i qpos = _mm512_load_si512(&ws.qpos[16 * r]), lo = _mm512_load_si512(&ws.lo[16 * r]);
    for (int j = 0; j < nk; ++j) {
      const __m512i kpos = _mm512_set1_epi32(static_cast<int>(c0 + j));
      const __mmask16 m = _mm512_cmpgt_epi32_mask(kpos, qpos) | _mm512_cmple_epi32_mask(kpos, lo);
      _mm512_mask_store_ps(&ws.s[j][16 * r], m, neg);
    }
  }
}

// Online softmax over the chunk's scores: updates the running max m / sum l per row, leaves the
// accumulator rescale in ws.corr and the probabilities as bf16 key pairs in ws.pp.
template <int D>
inline void softmax_chunk(Workspace<D>& ws, int nk, __m512* m, __m512* l) {
  const __m512i inter = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                         22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (int r = 0; r < RV; ++r) {
    __m512 mx[4] = {m[r], m[r], m[r], m[r]};
    for (int j = 0; j < nk; j += 4)
      for (int u = 0; u < 4; ++u) mx[u] = _mm512_max_ps(mx[u], _mm512_load_ps(&ws.s[j + u][16 * r]));
    const __m512 mnew = _mm512_max_ps(_mm512_max_ps(mx[0], mx[1]), _mm512_max_ps(mx[2], mx[3]));
    const __m512 corr = exp2_neg(_mm512_sub_ps(m[r], mnew));
    _mm512_store_ps(&ws.corr[16 * r], corr);
    m[r] = mnew;
    __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
    for (int kp = 0; kp < nk / 2; ++kp) {
      const __m512 p0 = exp2_neg(_mm512_sub_ps(_mm512_load_ps(&ws.s[2 * kp][16 * r]), mnew));
      const __m512 p1 = exp2_neg(_mm512_sub_ps(_mm512_load_ps(&ws.s[2 * kp + 1][16 * r]), mnew));
      sum0 = _mm512_add_ps(sum0, p0);
      sum1 = _mm512_add_ps(sum1, p1);
      const __m512i pair = _mm512_permutexvar_epi16(inter, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
      _mm512_store_si512(&ws.pp[kp][16 * r], pair);
    }
    l[r] = _mm512_fmadd_ps(l[r], corr, _mm512_add_ps(sum0, sum1));
  }
}

// vp[kp][d] = (v[2kp][d], v[2kp+1][d]) for the chunk's keys.
template <int D>
inline void pack_v(Workspace<D>& ws, int nk) {
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                      37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int kp = 0; kp < nk / 2; ++kp) {
    for (int c = 0; c < D / 32; ++c) {
      const __m512i a = _mm512_loadu_si512(ws.vptr[2 * kp] + 32 * c);
      const __m512i b = _mm512_loadu_si512(ws.vptr[2 * kp + 1] + 32 * c);
      _mm512_store_si512(&ws.vp[kp][32 * c], _mm512_permutex2var_epi16(a, lo, b));
      _mm512_store_si512(&ws.vp[kp][32 * c + 16], _mm512_permutex2var_epi16(a, hi, b));
    }
  }
}

// o[r0 .. r0+RB) = o * corr + P V for the chunk.
template <int D, int RB>
inline void pv_rows(Workspace<D>& ws, int nk, int r0) {
  constexpr int NV = D / 16;
  __m512 acc[RB][NV];
#pragma GCC unroll 12
  for (int r = 0; r < RB; ++r) {
    const __m512 c = _mm512_set1_ps(ws.corr[r0 + r]);
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_mul_ps(_mm512_load_ps(&ws.o[r0 + r][16 * v]), c);
  }
  for (int kp = 0; kp < nk / 2; ++kp) {
    __m512bh vv[NV];
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) vv[v] = (__m512bh)_mm512_load_si512(&ws.vp[kp][16 * v]);
#pragma GCC unroll 12
    for (int r = 0; r < RB; ++r) {
      const __m512bh pb = (__m512bh)_mm512_set1_epi32(static_cast<int>(ws.pp[kp][r0 + r]));
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], pb, vv[v]);
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) _mm512_store_ps(&ws.o[r0 + r][16 * v], acc[r][v]);
}

// Sets the tile's row positions and packs its Q rows (rows past the end repeat the last one, and
// are never stored); returns the number of real rows. (run_tile clears the output it accumulates.)
template <int D>
int setup_tile(const Problem& pr, const Item& it, Workspace<D>& ws, const uint16_t** qrow, int64_t* out_off) {
  const int64_t group = pr.hq / pr.hk, n = pr.qsl[it.seq + 1] - pr.qsl[it.seq], ctx = pr.lens[it.seq];
  const int64_t r0 = static_cast<int64_t>(it.tile) * TR;
  const int rows = static_cast<int>(std::min<int64_t>(TR, n * group - r0));
  for (int t = 0; t < TR; ++t) {
    const int64_t r = r0 + std::min(t, rows - 1), i = r / group, g = r % group;
    ws.qpos[t] = static_cast<int32_t>(ctx - n + i);
    ws.lo[t] = pr.window > 0 ? static_cast<int32_t>(ctx - n + i - pr.window) : -1;
    const int64_t row = pr.qsl[it.seq] + i, h = it.head * group + g;
    qrow[t] = pr.q + row * pr.q_stride + h * D;
    out_off[t] = (row * pr.hq + h) * D;
  }
  for (int r = 0; r < RV; ++r)
    for (int c = 0; c < D / 32; ++c) {
      __m512i x[16];
      for (int t = 0; t < 16; ++t) x[t] = _mm512_loadu_si512(qrow[16 * r + t] + 32 * c);
      tokenmill::transpose16x16(x);
      for (int t = 0; t < 16; ++t) _mm512_store_si512(&ws.qp[16 * c + t][16 * r], x[t]);
    }
  return rows;
}

#ifdef TOKENMILL_PREFILL_AMX
// The AMX-BF16 form of a tile's products (tiles 0-2: the C tiles of the tile's three 16-row blocks, 3: A, 4-6: B):
// - scores, C[key][row]: 16 gathered K rows (16 keys x 32 d) times qp's 16 d pairs x 16 rows, stored straight into
//   s[key][row], then scaled;
// - PV, transposed, C[d][row]: V^T (16 d x 16 key pairs: vp transposed) times pp's 16 key pairs x 16 rows, added
//   to ot[d][row], which each chunk first rescales row-wise (lanes = rows, as corr). PV takes all KC keys: P is
//   zero past the chunk's last key (pp cleared), where V is the zero row.
// The tile's three 16-row blocks, at columns 0, 16 and 32 of a [.][TR] array of 4-byte elements: C tiles 0-2 loaded
// from or stored to it, or B tiles 4-6 loaded from it and multiplied by A (tile 3) into C. Macros: the tile
// intrinsics take the tile's number as a literal.
#define TM_ROW_BLOCKS(op, p) \
  do {                       \
    op(0, (p), TR * 4);      \
    op(1, (p) + 16, TR * 4); \
    op(2, (p) + 32, TR * 4); \
  } while (0)
#define TM_DP_ROW_BLOCKS(p)              \
  do {                                   \
    _tile_loadd(4, (p), TR * 4);         \
    _tile_loadd(5, (p) + 16, TR * 4);    \
    _tile_loadd(6, (p) + 32, TR * 4);    \
    _tile_dpbf16ps(0, 3, 4);             \
    _tile_dpbf16ps(1, 3, 5);             \
    _tile_dpbf16ps(2, 3, 6);             \
  } while (0)

template <int D>
void scores_amx(Workspace<D>& ws, int nk, float c) {
  static_assert(RV == 3, "three C tiles hold a tile's rows");
  const int groups = (nk + 15) / 16;
  for (int j = 0; j < 16 * groups; ++j) std::memcpy(ws.kbuf[j], ws.kptr[j], D * sizeof(uint16_t));
  for (int g = 0; g < groups; ++g) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    for (int k = 0; k < D / 32; ++k) {
      _tile_loadd(3, &ws.kbuf[16 * g][32 * k], D * sizeof(uint16_t));
      TM_DP_ROW_BLOCKS(&ws.qp[16 * k][0]);
    }
    TM_ROW_BLOCKS(_tile_stored, &ws.s[16 * g][0]);
  }
  const __m512 cv = _mm512_set1_ps(c);
  for (int j = 0; j < nk; ++j)
    for (int r = 0; r < RV; ++r) _mm512_store_ps(&ws.s[j][16 * r], _mm512_mul_ps(_mm512_load_ps(&ws.s[j][16 * r]), cv));
}

template <int D>
void pv_amx(Workspace<D>& ws, int nk) {
  std::memset(ws.pp[nk / 2], 0, sizeof(ws.pp[0]) * (KC / 2 - nk / 2));
  pack_v(ws, KC);
  for (int r = 0; r < RV; ++r) {
    const __m512 corr = _mm512_load_ps(&ws.corr[16 * r]);
    for (int d = 0; d < D; ++d) _mm512_store_ps(&ws.ot[d][16 * r], _mm512_mul_ps(_mm512_load_ps(&ws.ot[d][16 * r]), corr));
  }
  for (int b = 0; b < D / 16; ++b) {
    __m512i x[16];
    for (int i = 0; i < 16; ++i) x[i] = _mm512_load_si512(&ws.vp[i][16 * b]);
    tokenmill::transpose16x16(x);  // x[d]: d = 16b + d's pairs over the 16 key pairs
    for (int i = 0; i < 16; ++i) _mm512_store_si512(ws.vt[i], x[i]);
    _tile_loadd(3, ws.vt, 64);
    TM_ROW_BLOCKS(_tile_loadd, &ws.ot[16 * b][0]);
    TM_DP_ROW_BLOCKS(&ws.pp[0][0]);
    TM_ROW_BLOCKS(_tile_stored, &ws.ot[16 * b][0]);
  }
}

// out[row] = ot[.][row] / l[row]: 16 x 16 blocks transposed back to rows
template <int D>
void store_rows_amx(const Problem& pr, Workspace<D>& ws, int rows, const int64_t* out_off) {
  for (int r = 0; r < RV && 16 * r < rows; ++r) {
    alignas(64) float inv[16];
    _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.f), _mm512_load_ps(&ws.l[16 * r])));
    for (int b = 0; b < D / 16; ++b) {
      __m512i x[16];
      for (int i = 0; i < 16; ++i) x[i] = _mm512_load_si512(&ws.ot[16 * b + i][16 * r]);
      tokenmill::transpose16x16(x);  // x[t]: row 16r + t's 16 d
      for (int t = 0; t < 16 && 16 * r + t < rows; ++t) {
        const __m512 v = _mm512_mul_ps(_mm512_castsi512_ps(x[t]), _mm512_set1_ps(inv[t]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr.out + out_off[16 * r + t] + 16 * b),
                            (__m256i)_mm512_cvtneps_pbh(v));
      }
    }
  }
}
#undef TM_ROW_BLOCKS
#undef TM_DP_ROW_BLOCKS
#endif

// kAmx: the products on AMX-BF16 tiles (scores_amx, pv_amx, the output kept transposed), else VDPBF16PS
template <int D, bool kAmx>
void run_tile(const Problem& pr, const Item& it, Workspace<D>& ws, const uint16_t* zero_row) {
  constexpr int RB = D == 32 ? 12 : D == 64 ? 6 : 3;
  static_assert(TR % RB == 0, "row blocks must tile the query tile");
  const uint16_t* qrow[TR];
  int64_t out_off[TR];
  const int rows = setup_tile(pr, it, ws, qrow, out_off);
  if constexpr (kAmx) {
#ifdef TOKENMILL_PREFILL_AMX
    std::memset(ws.ot, 0, sizeof(ws.ot));
#endif
  } else {
    std::memset(ws.o, 0, sizeof(ws.o));
  }
  const int64_t min_q = ws.qpos[0], max_q = ws.qpos[rows - 1];
  const int64_t kstart = pr.window > 0 ? std::max<int64_t>(0, min_q - pr.window + 1) : 0;
  const int32_t* table = pr.tables + it.seq * pr.max_blocks;
  const int64_t row_len = pr.hk * D;
  __m512 m[RV], l[RV];
  for (int r = 0; r < RV; ++r) m[r] = _mm512_set1_ps(kMasked), l[r] = _mm512_setzero_ps();
  for (int64_t c0 = kstart / KC * KC; c0 <= max_q; c0 += KC) {
    for (int j = 0; j < KC; ++j) {
      const int64_t k = c0 + j;
      const int64_t off = (table[k / pr.bs] * pr.bs + k % pr.bs) * row_len + it.head * D;
      ws.kptr[j] = k <= max_q ? pr.kc + off : zero_row;
      ws.vptr[j] = k <= max_q ? pr.vc + off : zero_row;
    }
    // keys past the tile's last row are skipped in whole groups of KG
    const int nk = static_cast<int>(std::min<int64_t>(KC, (max_q - c0) / KG * KG + KG));
    if constexpr (kAmx) {
#ifdef TOKENMILL_PREFILL_AMX
      scores_amx(ws, nk, pr.c);
#endif
    } else {
      for (int j = 0; j < nk; j += KG) scores(ws, ws.kptr + j, ws.s + j, pr.c);
    }
    if (c0 + nk - 1 > min_q || (pr.window > 0 && c0 <= max_q - pr.window)) mask_chunk(ws, c0, nk);
    softmax_chunk(ws, nk, m, l);
    if constexpr (kAmx) {
#ifdef TOKENMILL_PREFILL_AMX
      pv_amx(ws, nk);
#endif
    } else {
      pack_v(ws, nk);
      for (int r0 = 0; r0 < rows; r0 += RB) pv_rows<D, RB>(ws, nk, r0);
    }
  }
  for (int r = 0; r < RV; ++r) _mm512_store_ps(&ws.l[16 * r], l[r]);
  if constexpr (kAmx) {
#ifdef TOKENMILL_PREFILL_AMX
    store_rows_amx(pr, ws, rows, out_off);
#endif
  } else {
    for (int t = 0; t < rows; ++t) {
      uint16_t* dst = pr.out + out_off[t];
      const __m512 inv = _mm512_set1_ps(1.f / ws.l[t]);
      for (int v = 0; v < D / 16; ++v)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16 * v),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(&ws.o[t][16 * v]), inv)));
    }
  }
}

// Work items: the sequences most expensive first, then by kv head (its K/V stay in cache across
// the head's tiles), the longest tiles first; taken from a shared counter, this balances threads.
std::vector<Item> make_items(const Problem& pr, int64_t num_seqs) {
  std::vector<Item> items;
  const int64_t group = pr.hq / pr.hk;
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t n = pr.qsl[b + 1] - pr.qsl[b], ctx = pr.lens[b];
    const int64_t span = pr.window > 0 ? std::min(ctx, pr.window) : ctx;
    const int64_t cost = n * span;
    for (int64_t h = 0; h < pr.hk; ++h)
      for (int64_t t = (n * group - 1) / TR; t >= 0; --t)
        items.push_back({static_cast<int32_t>(b), static_cast<int32_t>(h), static_cast<int32_t>(t), cost});
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  return items;
}

template <int D>
void prefill(const Problem& pr, int64_t num_seqs, bool amx) {
  const std::vector<Item> items = make_items(pr, num_seqs);
  const int64_t n = static_cast<int64_t>(items.size());
  std::atomic<int64_t> next{0};
  alignas(64) static const uint16_t zero_row[128] = {};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::unique_ptr<Workspace<D>> ws(new Workspace<D>);  // default-initialised: no zeroing
#ifdef TOKENMILL_PREFILL_AMX
    if (amx) {
      tokenmill::AmxTileConfig cfg;
      for (int t = 0; t < 7; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
      _tile_loadconfig(&cfg);
      for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) run_tile<D, true>(pr, items[i], *ws, zero_row);
      _tile_release();
      return;
    }
#endif
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) run_tile<D, false>(pr, items[i], *ws, zero_row);
  });
}

#endif  // TOKENMILL_PREFILL_DPBF16

// whether prefill_attention runs its products on AMX-BF16 tiles here (compiled in, and the CPU grants it)
bool has_prefill_amx() {
#ifdef TOKENMILL_PREFILL_AMX
  return tokenmill::amx_bf16_permitted();
#else
  return false;
#endif
}

bool has_prefill_kernel(int64_t head_dim) {
#ifdef TOKENMILL_PREFILL_DPBF16
  return head_dim == 32 || head_dim == 64 || head_dim == 128;
#else
  (void)head_dim;
  return false;
#endif
}

// Writes out[qsl[0] .. qsl[P]) for the P prefill chunks described by query_start_loc / seq_lens /
// block_tables (their K/V already in the cache). bf16 only; see has_prefill_kernel.
void prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                       const at::Tensor& seq_lens, double scale, int64_t window, at::Tensor& out, bool amx) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "prefill_attention: q's heads must be contiguous rows");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && out.is_contiguous(),
              "prefill_attention: needs contiguous caches and out");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 &&
                  out.scalar_type() == at::kBFloat16 && out.sizes() == q.sizes(),
              "prefill_attention: needs bfloat16 q, caches and out of q's shape");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && query_start_loc.scalar_type() == at::kInt &&
                  seq_lens.scalar_type() == at::kInt,
              "prefill_attention: needs int32 metadata");
  const int64_t num_seqs = seq_lens.size(0), dim = q.size(2), hq = q.size(1), hk = k_cache.size(2);
  TORCH_CHECK(hq % hk == 0 && k_cache.size(3) == dim, "head shapes do not match");
  TORCH_CHECK(has_prefill_kernel(dim), "prefill_attention: unsupported head size or CPU");
  TORCH_CHECK(query_start_loc.size(0) == num_seqs + 1 && block_tables.size(0) == num_seqs, "bad metadata");
#ifdef TOKENMILL_PREFILL_DPBF16
  auto tables = block_tables.contiguous();
  auto qsl = query_start_loc.contiguous();
  auto lens = seq_lens.contiguous();
  const Problem pr{reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>()),
                   reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>()),
                   reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>()),
                   reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()),
                   qsl.data_ptr<int32_t>(), lens.data_ptr<int32_t>(), tables.data_ptr<int32_t>(),
                   tables.size(1), hq, hk, k_cache.size(1), q.stride(0),
                   static_cast<float>(scale) * kLog2e, window};
  const bool tiles = amx && has_prefill_amx();
  if (dim == 32) prefill<32>(pr, num_seqs, tiles);
  else if (dim == 64) prefill<64>(pr, num_seqs, tiles);
  else prefill<128>(pr, num_seqs, tiles);
#else
  (void)amx;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def("has_prefill_kernel(int head_dim) -> bool", &has_prefill_kernel);
  m.def("has_prefill_amx() -> bool", &has_prefill_amx);
  // amx: take AMX-BF16 tiles where has_prefill_amx (False: the VDPBF16PS products everywhere, their reference)
  m.def("prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor query_start_loc, "
        "Tensor seq_lens, float scale, int window, Tensor(a!) out, bool amx=True) -> ()");
}

TORCH_LIBRARY_IMPL(tokenmill_cpu, CPU, m) { m.impl("prefill_attention", &prefill_attention); }
