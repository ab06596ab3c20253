// Greedy sampling's argmax over bf16 logits on CPUs, straight from the bf16 bits; with a token bitmask
// (structured output, xgrammar's layout: int32 words, token t at bit t % 32 of word t // 32), the argmax
// over the tokens whose bit is set.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>

namespace {

using bf16 = at::BFloat16;

// argmax's order on bf16 bits as int16, 32 lanes a vector and no float conversion: a float's
// order and equality (-0 == +0), with NaN below everything (the max skips NaN, as before).
inline int16_t argmax_key(uint16_t h) {
  const int16_t mag = static_cast<int16_t>(h & 0x7fff);
  const int16_t key = (h & 0x8000) ? static_cast<int16_t>(-mag) : mag;
  return mag > 0x7f80 ? std::numeric_limits<int16_t>::min() : key;
}

// Row-wise argmax of bf16 logits [B, V] (the first index of the maximum, as torch's argmax), for
// greedy sampling without the float32 copy and torch's slower general reduction.
// One pass of block maxima remembers the first block holding the row's max; only it is rescanned.
at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "argmax_rows: needs bfloat16");
  TORCH_CHECK(x.is_contiguous() && x.dim() == 2, "argmax_rows: needs a contiguous 2-D tensor");
  const int64_t rows = x.size(0), v = x.size(1);
  TORCH_CHECK(v > 0, "argmax_rows: empty rows");
  auto out = at::empty({rows}, x.options().dtype(at::kLong));
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<bf16>());
  int64_t* op = out.data_ptr<int64_t>();
  constexpr int64_t kBlock = 512;
  constexpr int16_t kNaN = std::numeric_limits<int16_t>::min();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint16_t* row = xp + r * v;
      int16_t best = kNaN;
      int64_t at = 0;
      for (int64_t b = 0; b < v; b += kBlock) {
        const uint16_t* blk = row + b;
        const int64_t n = std::min(kBlock, v - b);
        int16_t m = kNaN;
#pragma omp simd reduction(max : m)
        for (int64_t i = 0; i < n; ++i) m = std::max(m, argmax_key(blk[i]));
        if (m > best) best = m, at = b;
      }
      // the first index of the max, within its block; a row all NaN gives the last index, as before
      if (best == kNaN) at = v - 1;
      else while (argmax_key(row[at]) != best) ++at;
      op[r] = at;
    }
  });
  return out;
}

// argmax_rows over the allowed tokens of each row: bitmask [B, words] int32, a row with every bit set is
// unconstrained. The same token as the float32 reference (a masked token set to -inf, then torch's
// argmax: the first index of the maximum); a token past the mask's words is not allowed. A row whose
// allowed tokens are all NaN or -inf gives its first allowed token (the reference's argmax would be 0
// whether allowed or not).
at::Tensor argmax_rows_masked(const at::Tensor& x, const at::Tensor& bitmask) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "argmax_rows_masked: needs bfloat16");
  TORCH_CHECK(x.is_contiguous() && x.dim() == 2, "argmax_rows_masked: needs a contiguous 2-D tensor");
  TORCH_CHECK(bitmask.scalar_type() == at::kInt && bitmask.is_contiguous() && bitmask.dim() == 2 &&
                  bitmask.size(0) == x.size(0),
              "argmax_rows_masked: the bitmask must be a contiguous int32 [rows, words]");
  const int64_t rows = x.size(0), v = x.size(1), words = bitmask.size(1);
  TORCH_CHECK(v > 0, "argmax_rows_masked: empty rows");
  auto out = at::empty({rows}, x.options().dtype(at::kLong));
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<bf16>());
  const uint32_t* mp = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  int64_t* op = out.data_ptr<int64_t>();
  constexpr int16_t kNaN = std::numeric_limits<int16_t>::min();
  const int16_t kNegInf = argmax_key(0xff80);
  const int64_t n_words = std::min(words, (v + 31) / 32);
  static constexpr uint16_t kLane[16] = {1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768};
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint16_t* row = xp + r * v;
      const uint32_t* mask = mp + r * words;
      int16_t best = kNaN;
      int64_t at = -1, first_allowed = -1;
      for (int64_t w = 0; w < n_words; ++w) {
        uint32_t bits = mask[w];
        if (bits == 0) continue;
        const int64_t base = w * 32;
        if (first_allowed < 0 && base + __builtin_ctz(bits) < v) first_allowed = base + __builtin_ctz(bits);
        if (base + 32 <= v) {  // the word's 32 tokens at once
          int16_t m = kNaN;
          if (bits == 0xffffffffu) {
#pragma omp simd reduction(max : m)
            for (int64_t i = 0; i < 32; ++i) m = std::max(m, argmax_key(row[base + i]));
          } else {  // a disallowed token's key is below every allowed one's; each half-word's bits as 16 lanes
            const uint16_t lo = static_cast<uint16_t>(bits), hi = static_cast<uint16_t>(bits >> 16);
#pragma omp simd reduction(max : m)
            for (int64_t i = 0; i < 16; ++i) m = std::max(m, (lo & kLane[i]) ? argmax_key(row[base + i]) : kNaN);
#pragma omp simd reduction(max : m)
            for (int64_t i = 0; i < 16; ++i)
              m = std::max(m, (hi & kLane[i]) ? argmax_key(row[base + 16 + i]) : kNaN);
          }
          if (m > best) {  // the first allowed token whose key is m is the row's argmax so far
            best = m;
            at = base;
            while (!((bits >> (at - base)) & 1u) || argmax_key(row[at]) != m) ++at;
          }
          continue;
        }
        while (bits) {
          const int64_t t = base + __builtin_ctz(bits);
          bits &= bits - 1;
          if (t >= v) break;
          const int16_t k = argmax_key(row[t]);
          if (k > best) best = k, at = t;
        }
      }
      // every allowed token NaN or -inf (or none allowed): the first allowed token, else 0
      if (at < 0 || best <= kNegInf) at = first_allowed < 0 ? 0 : first_allowed;
      op[r] = at;
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("argmax_rows_masked(Tensor x, Tensor bitmask) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill_cpu, CPU, m) {
  m.impl("argmax_rows", &argmax_rows);
  m.impl("argmax_rows_masked", &argmax_rows_masked);
}
