// Helpers shared by tokenmill's CPU kernels: a vectorisable exp and bit-level bf16 conversions.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace tokenmill {

// exp(x) to ~2 ulp over the float range, in a form loops vectorize (libm's expf does not):
// x = n ln2 + r with |r| <= ln2/2, exp(r) by a degree-6 polynomial, 2^n from exponent bits.
inline float exp_approx(float x) {
  x = std::min(std::max(x, -87.f), 88.f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = (x - n * 0.693145751953125f) - n * 1.42860682030941723212e-6f;
  float p = 1.3888889e-3f;
  p = p * r + 8.3333333e-3f;
  p = p * r + 4.1666667e-2f;
  p = p * r + 1.6666667e-1f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
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
    const float corr = exp_approx(m[h] - bmax);
    m[h] = bmax;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < n; ++j) {
      sh[j] = exp_approx(sh[j] - bmax);
      sum += sh[j];
    }
    l[h] = l[h] * corr + sum;
    float* a = acc + h * dim;
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) a[d] *= corr;
  }
}

// f(std::integral_constant<int, m>) for a row count m in [M, MAX] (MAX for any larger m): the templates' row
// counts chosen at run time (M <= m)
template <int M, int MAX, typename F>
inline void with_rows(int64_t m, F&& f) {
  if constexpr (M < MAX) {
    if (m != M) return with_rows<M + 1, MAX>(m, f);
  }
  f(std::integral_constant<int, M>{});
}

inline float bf16_bits_to_f32(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// round-to-nearest-even float -> bf16 bits (inputs here are finite)
inline uint16_t f32_to_bf16_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  bits += 0x7fff + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

}  // namespace tokenmill
