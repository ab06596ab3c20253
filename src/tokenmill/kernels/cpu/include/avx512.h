// AVX-512 pieces shared by the CPU kernels (attention/paged_decode.cpp, attention/paged_decode_quant.cpp,
// attention/prefill_attention.cpp, linear/quantized.cpp, linear/dequant_amx.cpp): a 16-lane exp, the online
// softmax of one head over a tile of 16 keys, a mask of the first n lanes, the in-lane 4x4 transpose of dwords
// that puts 4 keys' dims side by side, and a 16 x 16 one.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

#include "common.h"

namespace tokenmill {

// exp_approx (common.h) on 16 lanes, lanes outside valid set to 0. No clamping: callers keep x <= 8,
// and scalef takes a very negative x to 0 as it should.
inline __m512 exp16(__m512 x, __mmask16 valid) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723212e-6f),
                                    _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x));
  __m512 p = _mm512_set1_ps(1.3888889e-3f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3333333e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1666667e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666667e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_maskz_scalef_ps(valid, p, n);
}

// Online softmax of one head over a tile: folds scores s (lanes in valid) into the running max m and
// the lane-wise running sum l; returns the tile's unnormalised probabilities (0 outside valid) and sets
// corr to the factor that rescales the head's accumulator. exp(s - m) is right for any m, so m is
// raised only when a score passes m + 8 (no overflow below e^8): most tiles skip the reduction and
// the rescale.
inline __m512 tile_softmax(__m512 s, __mmask16 valid, float& m, __m512& l, float& corr) {
  corr = 1.f;
  if (_mm512_mask_cmp_ps_mask(valid, s, _mm512_set1_ps(m + 8.f), _CMP_GT_OQ)) {
    const float top = _mm512_mask_reduce_max_ps(valid, s);
    corr = exp_approx(m - top);
    m = top;
    l = _mm512_mul_ps(l, _mm512_set1_ps(corr));
  }
  const __m512 p = exp16(_mm512_sub_ps(s, _mm512_set1_ps(m)), valid);
  l = _mm512_add_ps(l, p);
  return p;
}

// the first n of 16 lanes (none for n <= 0, all for n >= 16)
inline __mmask16 first_lanes(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : n <= 0 ? 0 : static_cast<__mmask16>((1u << n) - 1);
}

// 4 rows x[0..3] (16 dwords each) -> u[b] lane (L, k) = dword 4L + b of row k
__attribute__((always_inline)) inline void transpose4x4(const __m512i* x, __m512i* u) {
  const __m512i t0 = _mm512_unpacklo_epi32(x[0], x[1]), t1 = _mm512_unpackhi_epi32(x[0], x[1]);
  const __m512i t2 = _mm512_unpacklo_epi32(x[2], x[3]), t3 = _mm512_unpackhi_epi32(x[2], x[3]);
  u[0] = _mm512_unpacklo_epi64(t0, t2);
  u[1] = _mm512_unpackhi_epi64(t0, t2);
  u[2] = _mm512_unpacklo_epi64(t1, t3);
  u[3] = _mm512_unpackhi_epi64(t1, t3);
}

// 16 rows of 16 dwords, transposed in place: x[j] becomes dword j of every row
inline void transpose16x16(__m512i* x) {
  __m512i u[16];  // u[4g + b], lane L: dword 4L + b of rows 4g..4g+3
  for (int g = 0; g < 4; ++g) transpose4x4(x + 4 * g, u + 4 * g);
  for (int b = 0; b < 4; ++b) {  // a 4 x 4 transpose of 128-bit lanes
    const __m512i v0 = _mm512_shuffle_i32x4(u[b], u[4 + b], 0x44), v1 = _mm512_shuffle_i32x4(u[b], u[4 + b], 0xEE);
    const __m512i w0 = _mm512_shuffle_i32x4(u[8 + b], u[12 + b], 0x44);
    const __m512i w1 = _mm512_shuffle_i32x4(u[8 + b], u[12 + b], 0xEE);
    x[b] = _mm512_shuffle_i32x4(v0, w0, 0x88);
    x[4 + b] = _mm512_shuffle_i32x4(v0, w0, 0xDD);
    x[8 + b] = _mm512_shuffle_i32x4(v1, w1, 0x88);
    x[12 + b] = _mm512_shuffle_i32x4(v1, w1, 0xDD);
  }
}

}  // namespace tokenmill
#endif
