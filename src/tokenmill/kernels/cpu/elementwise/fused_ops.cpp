// Fused elementwise ops for bfloat16 on CPUs, each one pass over memory instead of the several
// kernels (and float32 temporaries) the torch reference path launches. Rounding follows the
// reference: float32 arithmetic, rounded to bfloat16 where the reference stores a bfloat16.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "common.h"
#include "kernels.h"

namespace tokenmill {

void rotary_rows(uint16_t* xp, int64_t t, int64_t heads, int64_t d, int64_t st, int64_t sh, const int64_t* pp,
                 const uint16_t* cp, const uint16_t* sp) {
  const int64_t half = d / 2;
  auto r16 = [](float f) { return bf16_bits_to_f32(f32_to_bf16_bits(f)); };
  at::parallel_for(0, t, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const uint16_t* c = cp + pp[i] * d;
      const uint16_t* s = sp + pp[i] * d;
      for (int64_t hh = 0; hh < heads; ++hh) {
        uint16_t* v = xp + i * st + hh * sh;
#pragma omp simd
        for (int64_t j = 0; j < half; ++j) {
          const float a = bf16_bits_to_f32(v[j]), b = bf16_bits_to_f32(v[j + half]);
          const float lo = r16(a * bf16_bits_to_f32(c[j])) + r16(-b * bf16_bits_to_f32(s[j]));
          const float hi = r16(b * bf16_bits_to_f32(c[j + half])) + r16(a * bf16_bits_to_f32(s[j + half]));
          v[j] = f32_to_bf16_bits(lo);
          v[j + half] = f32_to_bf16_bits(hi);
        }
      }
    }
  });
}

void write_kv_rows(const char* kp, const char* vp, int64_t k_stride, int64_t v_stride, char* kc, char* vc,
                   const int64_t* sp, int64_t t, int64_t row_bytes, int64_t num_slots) {
  for (int64_t i = 0; i < t; ++i) {
    TORCH_CHECK(sp[i] >= 0 && sp[i] < num_slots, "write_kv: slot ", sp[i], " out of range");
    std::memcpy(kc + sp[i] * row_bytes, kp + i * k_stride, row_bytes);
    std::memcpy(vc + sp[i] * row_bytes, vp + i * v_stride, row_bytes);
  }
}

}  // namespace tokenmill

namespace {

using bf16 = at::BFloat16;
using tokenmill::bf16_bits_to_f32;
using tokenmill::exp_approx;
using tokenmill::f32_to_bf16_bits;


void check_rows(const at::Tensor& x, const char* what) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, what, ": needs bfloat16");
  TORCH_CHECK(x.is_contiguous() && x.dim() == 2, what, ": needs a contiguous 2-D tensor");
}

// out = weight * bf16(x / rms(x)); with residual: residual = bf16(x + residual) first, in place,
// and the norm is taken of the new residual. Returns out.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                    const c10::optional<at::Tensor>& residual) {
  check_rows(x, "rms_norm");
  const int64_t rows = x.size(0), h = x.size(1);
  auto out = at::empty_like(x);
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<bf16>());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr<bf16>());
  uint16_t* rp = residual.has_value() ? reinterpret_cast<uint16_t*>(residual->data_ptr<bf16>()) : nullptr;
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr<bf16>());
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint16_t* src = xp + r * h;
      if (rp != nullptr) {
        uint16_t* res = rp + r * h;
#pragma omp simd
        for (int64_t i = 0; i < h; ++i) res[i] = f32_to_bf16_bits(bf16_bits_to_f32(src[i]) + bf16_bits_to_f32(res[i]));
        src = res;
      }
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < h; ++i) ss += bf16_bits_to_f32(src[i]) * bf16_bits_to_f32(src[i]);
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(h) + static_cast<float>(eps));
      uint16_t* o = op + r * h;
#pragma omp simd
      for (int64_t i = 0; i < h; ++i) {
        const float normed = bf16_bits_to_f32(f32_to_bf16_bits(bf16_bits_to_f32(src[i]) * inv));
        o[i] = f32_to_bf16_bits(bf16_bits_to_f32(wp[i]) * normed);
      }
    }
  });
  return out;
}

// [T, 2I] -> [T, I]: bf16(silu(gate)) * up
at::Tensor silu_and_mul(const at::Tensor& x) {
  check_rows(x, "silu_and_mul");
  const int64_t rows = x.size(0), inter = x.size(1) / 2;
  auto out = at::empty({rows, inter}, x.options());
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<bf16>());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr<bf16>());
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint16_t* g = xp + r * 2 * inter;
      const uint16_t* u = g + inter;
      uint16_t* o = op + r * inter;
#pragma omp simd
      for (int64_t i = 0; i < inter; ++i) {
        const float gv = bf16_bits_to_f32(g[i]);
        const float silu = bf16_bits_to_f32(f32_to_bf16_bits(gv / (1.f + exp_approx(-gv))));
        o[i] = f32_to_bf16_bits(silu * bf16_bits_to_f32(u[i]));
      }
    }
  });
  return out;
}

// In place on x [T, H, D] (any row stride): x = bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)),
// cos/sin [P, D] indexed by positions [T].
void rotary_(at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 3 && x.stride(2) == 1, "rotary: bad x");
  TORCH_CHECK(cos.scalar_type() == at::kBFloat16 && cos.is_contiguous() && sin.is_contiguous(), "rotary: cos/sin");
  auto pos = positions.contiguous();
  tokenmill::rotary_rows(reinterpret_cast<uint16_t*>(x.data_ptr<bf16>()), x.size(0), x.size(1), x.size(2),
                         x.stride(0), x.stride(1), pos.data_ptr<int64_t>(),
                         reinterpret_cast<const uint16_t*>(cos.data_ptr<bf16>()),
                         reinterpret_cast<const uint16_t*>(sin.data_ptr<bf16>()));
}

// Stores this step's keys and values [T, H, D] (rows may be strided, as splits of a fused qkv
// projection are) at their cache slots: cache [num_blocks, block_size, H, D] viewed as slots of
// H * D contiguous elements. Any dtype; one memcpy per row and tensor.
void write_kv_(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
               const at::Tensor& slot_mapping) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "write_kv: bad shapes");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == k_cache.scalar_type(),
              "write_kv: dtypes differ");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "write_kv: caches must be contiguous");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == k.size(0), "write_kv: slots");
  const int64_t t = k.size(0), row = k.size(1) * k.size(2), elem = k.element_size();
  TORCH_CHECK(k_cache.size(2) * k_cache.size(3) == row, "write_kv: head shapes differ from the cache");
  for (const at::Tensor* x : {&k, &v})
    TORCH_CHECK(x->stride(2) == 1 && x->stride(1) == x->size(2), "write_kv: heads of a row must be contiguous");
  auto slots = slot_mapping.contiguous();
  tokenmill::write_kv_rows(static_cast<const char*>(k.data_ptr()), static_cast<const char*>(v.data_ptr()),
                           k.stride(0) * elem, v.stride(0) * elem, static_cast<char*>(k_cache.data_ptr()),
                           static_cast<char*>(v_cache.data_ptr()), slots.data_ptr<int64_t>(), t, row * elem,
                           k_cache.size(0) * k_cache.size(1));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor(a!)? residual) -> Tensor");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("rotary_(Tensor(a!) x, Tensor positions, Tensor cos, Tensor sin) -> ()");
  m.def("write_kv_(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(tokenmill_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary_", &rotary_);
  m.impl("write_kv_", &write_kv_);
}
