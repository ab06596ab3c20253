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

}  // namespace tokenmill
