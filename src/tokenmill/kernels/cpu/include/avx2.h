// AVX2 helpers shared by tokenmill's CPU kernels (include under __AVX2__).
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace tokenmill {

// 8 bf16 bit patterns -> 8 float32 (each widens exactly: a 16-bit shift)
inline __m256 widen8_bf16(const uint16_t* w) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// the sum of v's 8 lanes: (0 + 4) + (2 + 6), then + ((1 + 5) + (3 + 7))
inline float hsum8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

}  // namespace tokenmill
