// Paged attention over a quantized KV cache (int8 or fp8 e4m3, one float32 scale per token and kv
// head: value = element * scale), read in place: each row of the cache is widened to float in a
// row-sized buffer as it is used, never the whole context. Every query row is one work item attending
// over its own context length, so a step's decodes and prefill rows go in one call (a prefill row at
// position p is a decode over the first p + 1 positions). K scales multiply the dot products, V scales
// the probabilities. Online softmax per block, float32 accumulation.
//
// Also the quantizing store of a step's K/V (write_kv_quant_), the same arithmetic as
// attention/kv_quant.py's quantize: scale = amax / qmax (1 where amax is 0), element = x / scale
// rounded to nearest even (int8 clamped to +-127, fp8 saturated to +-448).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "common.h"

namespace {

const float* fp8_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int i = 0; i < 256; ++i) t[i] = c10::detail::fp8e4m3fn_to_fp32_value(static_cast<uint8_t>(i));
    return t;
  }();
  return table.data();
}

inline void widen(const int8_t* src, float* dst, int64_t n, const float*) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

inline void widen(const uint8_t* src, float* dst, int64_t n, const float* lut) {
  for (int64_t i = 0; i < n; ++i) dst[i] = lut[src[i]];
}

template <typename T>
inline float to_float(T x) { return static_cast<float>(x); }

template <int64_t DIM>
inline float dot(const float* a, const float* b, int64_t n) {
  const int64_t len = DIM > 0 ? DIM : n;
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < len; ++i) acc += a[i] * b[i];
  return acc;
}

template <int64_t DIM>
inline void axpy(float p, const float* x, float* y, int64_t n) {
  const int64_t len = DIM > 0 ? DIM : n;
#pragma omp simd
  for (int64_t i = 0; i < len; ++i) y[i] += p * x[i];
}

struct Shape {
  int64_t rows, hq, hk, dim, bs, max_blocks, window;
  float scale;
};

// T: query/output dtype; E: the cache's element storage (int8_t, or uint8_t bits of fp8 e4m3)
template <typename T, typename E, int64_t DIM>
void attend(const T* q, int64_t q_row_stride, int64_t q_head_stride, const E* kc, const E* vc, const float* ks,
            const float* vs, const int32_t* tables, const int32_t* lens, T* out, const Shape& sh) {
  const int64_t hq = sh.hq, hk = sh.hk, dim = sh.dim, bs = sh.bs, group = hq / hk, row_len = hk * dim;
  const float* lut = fp8_table();
  at::parallel_for(0, sh.rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(hq * dim), acc(hq * dim), row(row_len), s(hq * bs), m(hq), l(hq);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t len = lens[r];
      const int64_t start = sh.window > 0 ? std::max<int64_t>(0, len - sh.window) : 0;
      for (int64_t h = 0; h < hq; ++h)
        for (int64_t d = 0; d < dim; ++d)
          qf[h * dim + d] = to_float(q[r * q_row_stride + h * q_head_stride + d]) * sh.scale;
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.f);
      const int32_t* table = tables + r * sh.max_blocks;
      for (int64_t bi = start / bs; bi * bs < len; ++bi) {
        const int64_t p0 = std::max(start, bi * bs), n = std::min(len, (bi + 1) * bs) - p0;
        const int64_t slot0 = static_cast<int64_t>(table[bi]) * bs + (p0 - bi * bs);
        for (int64_t j = 0; j < n; ++j) {
          const int64_t slot = slot0 + j;
          widen(kc + slot * row_len, row.data(), row_len, lut);
          for (int64_t kh = 0, h = 0; kh < hk; ++kh)
            for (int64_t g = 0; g < group; ++g, ++h)
              s[h * bs + j] = dot<DIM>(qf.data() + h * dim, row.data() + kh * dim, dim) * ks[slot * hk + kh];
        }
        for (int64_t h = 0; h < hq; ++h) {  // online softmax over the block
          float* sh_ = s.data() + h * bs;
          float bmax = m[h];
          for (int64_t j = 0; j < n; ++j) bmax = std::max(bmax, sh_[j]);
          const float corr = tokenmill::exp_approx(m[h] - bmax);
          m[h] = bmax;
          float sum = 0.f;
          for (int64_t j = 0; j < n; ++j) {
            sh_[j] = tokenmill::exp_approx(sh_[j] - bmax);
            sum += sh_[j];
          }
          l[h] = l[h] * corr + sum;
          for (int64_t d = 0; d < dim; ++d) acc[h * dim + d] *= corr;
        }
        for (int64_t j = 0; j < n; ++j) {
          const int64_t slot = slot0 + j;
          widen(vc + slot * row_len, row.data(), row_len, lut);
          for (int64_t kh = 0, h = 0; kh < hk; ++kh) {
            const float vscale = vs[slot * hk + kh];
            for (int64_t g = 0; g < group; ++g, ++h)
              axpy<DIM>(s[h * bs + j] * vscale, row.data() + kh * dim, acc.data() + h * dim, dim);
          }
        }
      }
      for (int64_t h = 0; h < hq; ++h) {
        const float inv = l[h] > 0.f ? 1.f / l[h] : 0.f;
        for (int64_t d = 0; d < dim; ++d) out[(r * hq + h) * dim + d] = static_cast<T>(acc[h * dim + d] * inv);
      }
    }
  });
}

template <typename T, typename E>
void dispatch_dim(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& ks,
                  const at::Tensor& vs, const at::Tensor& tables, const at::Tensor& lens, at::Tensor& out,
                  const Shape& sh) {
  auto kernel = sh.dim == 64 ? attend<T, E, 64> : sh.dim == 128 ? attend<T, E, 128> : attend<T, E, 0>;
  kernel(q.data_ptr<T>(), q.stride(0), q.stride(1), static_cast<const E*>(kc.data_ptr()),
         static_cast<const E*>(vc.data_ptr()), ks.data_ptr<float>(), vs.data_ptr<float>(), tables.data_ptr<int32_t>(),
         lens.data_ptr<int32_t>(), out.data_ptr<T>(), sh);
}

template <typename T>
void dispatch_cache(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& ks,
                    const at::Tensor& vs, const at::Tensor& tables, const at::Tensor& lens, at::Tensor& out,
                    const Shape& sh) {
  if (kc.scalar_type() == at::kChar) dispatch_dim<T, int8_t>(q, kc, vc, ks, vs, tables, lens, out, sh);
  else dispatch_dim<T, uint8_t>(q, kc, vc, ks, vs, tables, lens, out, sh);
}

at::Tensor paged_attention_quant(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                 const at::Tensor& k_scales, const at::Tensor& v_scales, const at::Tensor& block_tables,
                                 const at::Tensor& seq_lens, double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(k_scales.sizes() == k_cache.sizes().slice(0, 3) && v_scales.sizes() == k_scales.sizes(),
              "scales must be [num_blocks, block_size, kv_heads]");
  TORCH_CHECK(q.stride(2) == 1 && k_cache.is_contiguous() && v_cache.is_contiguous() && k_scales.is_contiguous() &&
                  v_scales.is_contiguous(), "need contiguous");
  const auto cdt = k_cache.scalar_type();
  TORCH_CHECK((cdt == at::kChar || cdt == at::kFloat8_e4m3fn) && v_cache.scalar_type() == cdt,
              "paged_attention_quant: the cache must be int8 or float8_e4m3fn");
  TORCH_CHECK(k_scales.scalar_type() == at::kFloat && v_scales.scalar_type() == at::kFloat, "scales must be float32");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt, "need int32");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == q.size(0) && seq_lens.numel() == q.size(0),
              "one block table and one length per query row");
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  const Shape sh{q.size(0), q.size(1), k_cache.size(2), q.size(2), k_cache.size(1), tables.size(1), window,
                 static_cast<float>(scale)};
  TORCH_CHECK(sh.hq % sh.hk == 0 && k_cache.size(3) == sh.dim, "head shapes do not match");
  const int64_t num_blocks = k_cache.size(0);
  const int32_t* t = tables.data_ptr<int32_t>();
  const int32_t* n = lens.data_ptr<int32_t>();
  for (int64_t r = 0; r < sh.rows; ++r) {  // a bad table must not read outside the pool
    TORCH_CHECK(n[r] >= 0 && n[r] <= sh.max_blocks * sh.bs, "context length past the block table");
    for (int64_t b = 0; b * sh.bs < n[r]; ++b)
      TORCH_CHECK(t[r * sh.max_blocks + b] >= 0 && t[r * sh.max_blocks + b] < num_blocks, "block id out of range");
  }
  auto out = at::empty(q.sizes(), q.options());
  switch (q.scalar_type()) {
    case at::kFloat: dispatch_cache<float>(q, k_cache, v_cache, k_scales, v_scales, tables, lens, out, sh); break;
    case at::kBFloat16:
      dispatch_cache<at::BFloat16>(q, k_cache, v_cache, k_scales, v_scales, tables, lens, out, sh);
      break;
    case at::kHalf: dispatch_cache<at::Half>(q, k_cache, v_cache, k_scales, v_scales, tables, lens, out, sh); break;
    default: TORCH_CHECK(false, "paged_attention_quant: unsupported query dtype ", q.scalar_type());
  }
  return out;
}

// x [t, hk, dim] (rows may be strided, each head's values contiguous) -> cache rows at slots, scales beside
template <typename T, typename E>
void quantize_rows(const at::Tensor& x, at::Tensor& cache, at::Tensor& scales, const int64_t* slots) {
  const int64_t t = x.size(0), hk = x.size(1), dim = x.size(2);
  const T* src = x.data_ptr<T>();
  E* dst = static_cast<E*>(cache.data_ptr());
  float* sc = scales.data_ptr<float>();
  const bool is_int8 = std::is_same_v<E, int8_t>;
  const float qmax = is_int8 ? 127.f : 448.f;
  at::parallel_for(0, t * hk, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / hk, h = i % hk;
      const T* xs = src + r * x.stride(0) + h * x.stride(1);
      float amax = 0.f;
      for (int64_t d = 0; d < dim; ++d) amax = std::max(amax, std::abs(to_float(xs[d])));
      const float s = amax > 0.f ? amax / qmax : 1.f;
      E* out = dst + (slots[r] * hk + h) * dim;
      for (int64_t d = 0; d < dim; ++d) {
        const float y = std::min(std::max(to_float(xs[d]) / s, -qmax), qmax);
        if constexpr (std::is_same_v<E, int8_t>) out[d] = static_cast<int8_t>(std::nearbyint(y));
        else out[d] = c10::Float8_e4m3fn(y).x;
      }
      sc[slots[r] * hk + h] = s;
    }
  });
}

void write_kv_quant_(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
                     at::Tensor& k_scales, at::Tensor& v_scales, const at::Tensor& slot_mapping) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.stride(2) == 1 && v.stride(2) == 1, "bad k/v");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_scales.is_contiguous() &&
                  v_scales.is_contiguous(), "need contiguous caches");
  TORCH_CHECK(k_cache.size(2) == k.size(1) && k_cache.size(3) == k.size(2), "k/v do not match the cache's heads");
  TORCH_CHECK(k_scales.scalar_type() == at::kFloat && v_scales.scalar_type() == at::kFloat, "scales must be float32");
  auto slots = slot_mapping.to(at::kLong).contiguous();
  TORCH_CHECK(slots.numel() == k.size(0), "one slot per row");
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < slots.numel(); ++i) TORCH_CHECK(sp[i] >= 0 && sp[i] < num_slots, "slot out of range");
  const auto cdt = k_cache.scalar_type();
  TORCH_CHECK((cdt == at::kChar || cdt == at::kFloat8_e4m3fn) && v_cache.scalar_type() == cdt,
              "write_kv_quant_: the cache must be int8 or float8_e4m3fn");
  auto run = [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    if (cdt == at::kChar) {
      quantize_rows<T, int8_t>(k, k_cache, k_scales, sp);
      quantize_rows<T, int8_t>(v, v_cache, v_scales, sp);
    } else {
      quantize_rows<T, uint8_t>(k, k_cache, k_scales, sp);
      quantize_rows<T, uint8_t>(v, v_cache, v_scales, sp);
    }
  };
  switch (k.scalar_type()) {
    case at::kFloat: run(static_cast<float*>(nullptr)); break;
    case at::kBFloat16: run(static_cast<at::BFloat16*>(nullptr)); break;
    case at::kHalf: run(static_cast<at::Half*>(nullptr)); break;
    default: TORCH_CHECK(false, "write_kv_quant_: unsupported dtype ", k.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def("paged_attention_quant(Tensor q, Tensor k_cache, Tensor v_cache, Tensor k_scales, Tensor v_scales, "
        "Tensor block_tables, Tensor seq_lens, float scale, int window) -> Tensor");
  m.def("write_kv_quant_(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor(c!) k_scales, "
        "Tensor(d!) v_scales, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(tokenmill_cpu, CPU, m) {
  m.impl("paged_attention_quant", &paged_attention_quant);
  m.impl("write_kv_quant_", &write_kv_quant_);
}
