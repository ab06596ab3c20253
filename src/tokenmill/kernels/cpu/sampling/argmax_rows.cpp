// Greedy sampling's argmax over bf16 or float32 logits on CPUs, straight from the bits; with a token bitmask
// (structured output, xgrammar's layout: int32 words, token t at bit t % 32 of word t // 32), the argmax
// over the tokens whose bit is set.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>

namespace {


// argmax's order on bf16 bits as int16, 32 lanes a vector and no float conversion: a float's
// order and equality (-0 == +0), with NaN below everything (the max skips NaN, as before).
inline int16_t argmax_key(uint16_t h) {
  const int16_t mag = static_cast<int16_t>(h & 0x7fff);
  const int16_t key = (h & 0x8000) ? static_cast<int16_t>(-mag) : mag;
  return mag > 0x7f80 ? std::numeric_limits<int16_t>::min() : key;
}

// The same order on float32 bits as int32, 8 lanes a 256-bit vector.
inline int32_t argmax_key(uint32_t b) {
  const int32_t mag = static_cast<int32_t>(b & 0x7fffffffu);
  const int32_t key = (b & 0x80000000u) ? -mag : mag;
  return mag > 0x7f800000 ? std::numeric_limits<int32_t>::min() : key;
}

constexpr uint16_t neg_inf_bits(uint16_t) { return 0xff80; }
constexpr uint32_t neg_inf_bits(uint32_t) { return 0xff800000u; }

// The logits' bits as Bits (uint16_t: bf16, uint32_t: float32), checked.
template <typename Bits>
const Bits* logit_bits(const at::Tensor& x) {
  return reinterpret_cast<const Bits*>(x.data_ptr());
}

void check_logits(const at::Tensor& x, const char* what) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, what, ": needs bfloat16 or float32");
  TORCH_CHECK(x.is_contiguous() && x.dim() == 2, what, ": needs a contiguous 2-D tensor");
  TORCH_CHECK(x.size(1) > 0, what, ": empty rows");
}

// Row-wise argmax of logits [B, V] (the first index of the maximum, as torch's argmax), for greedy sampling
// without a float32 copy and torch's slower general reduction.
// One pass of block maxima remembers the first block holding the row's max; only it is rescanned.
template <typename Bits>
void argmax_rows_of(const at::Tensor& x, int64_t* op) {
  using Key = decltype(argmax_key(Bits{}));
  const int64_t rows = x.size(0), v = x.size(1);
  const Bits* xp = logit_bits<Bits>(x);
  constexpr int64_t kBlock = 512;
  constexpr Key kNaN = std::numeric_limits<Key>::min();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const Bits* row = xp + r * v;
      Key best = kNaN;
      int64_t at = 0;
      for (int64_t b = 0; b < v; b += kBlock) {
        const Bits* blk = row + b;
        const int64_t n = std::min(kBlock, v - b);
        Key m = kNaN;
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
}

at::Tensor argmax_rows(const at::Tensor& x) {
  check_logits(x, "argmax_rows");
  auto out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  if (x.scalar_type() == at::kFloat) {
    argmax_rows_of<uint32_t>(x, out.data_ptr<int64_t>());
  } else {
    argmax_rows_of<uint16_t>(x, out.data_ptr<int64_t>());
  }
  return out;
}

// argmax_rows over the allowed tokens of each row: bitmask [B, words] int32, a row with every bit set is
// unconstrained. The same token as the float32 reference (a masked token set to -inf, then torch's
// argmax: the first index of the maximum); a token past the mask's words is not allowed. A row whose
// allowed tokens are all NaN or -inf gives its first allowed token (the reference's argmax would be 0
// whether allowed or not).
template <typename Bits>
void argmax_rows_masked_of(const at::Tensor& x, const at::Tensor& bitmask, int64_t* op) {
  using Key = decltype(argmax_key(Bits{}));
  const int64_t rows = x.size(0), v = x.size(1), words = bitmask.size(1);
  const Bits* xp = logit_bits<Bits>(x);
  const uint32_t* mp = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  constexpr Key kNaN = std::numeric_limits<Key>::min();
  const Key kNegInf = argmax_key(neg_inf_bits(Bits{}));
  const int64_t n_words = std::min(words, (v + 31) / 32);
  static constexpr uint16_t kLane[16] = {1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768};
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const Bits* row = xp + r * v;
      const uint32_t* mask = mp + r * words;
      Key best = kNaN;
      int64_t at = -1, first_allowed = -1;
      for (int64_t w = 0; w < n_words; ++w) {
        uint32_t bits = mask[w];
        if (bits == 0) continue;
        const int64_t base = w * 32;
        if (first_allowed < 0 && base + __builtin_ctz(bits) < v) first_allowed = base + __builtin_ctz(bits);
        if (base + 32 <= v) {  // the word's 32 tokens at once
          Key m = kNaN;
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
          const Key k = argmax_key(row[t]);
          if (k > best) best = k, at = t;
        }
      }
      // every allowed token NaN or -inf (or none allowed): the first allowed token, else 0
      if (at < 0 || best <= kNegInf) at = first_allowed < 0 ? 0 : first_allowed;
      op[r] = at;
    }
  });
}

at::Tensor argmax_rows_masked(const at::Tensor& x, const at::Tensor& bitmask) {
  check_logits(x, "argmax_rows_masked");
  TORCH_CHECK(bitmask.scalar_type() == at::kInt && bitmask.is_contiguous() && bitmask.dim() == 2 &&
                  bitmask.size(0) == x.size(0),
              "argmax_rows_masked: the bitmask must be a contiguous int32 [rows, words]");
  auto out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  if (x.scalar_type() == at::kFloat) {
    argmax_rows_masked_of<uint32_t>(x, bitmask, out.data_ptr<int64_t>());
  } else {
    argmax_rows_masked_of<uint16_t>(x, bitmask, out.data_ptr<int64_t>());
  }
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
