// Fused elementwise ops for bfloat16 and float32 rows on CPUs, each one pass over memory instead of the
// several kernels (and float32 temporaries) the torch reference path launches. Rounding follows the
// reference: float32 arithmetic, rounded to the rows' dtype where the reference stores one. For float32 rows
// those roundings are nothing, and the compiler may fuse a multiply and add that torch rounds apart, so a
// result can differ from torch's in its last bit.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "common.h"
#include "kernels.h"

namespace tokenmill {

// An element type's loads and stores as float32, and the reference's rounding to it.
struct Bf16Rows {
  using T = uint16_t;
  static float load(T v) { return bf16_bits_to_f32(v); }
  static T store(float f) { return f32_to_bf16_bits(f); }
  static float round(float f) { return bf16_bits_to_f32(f32_to_bf16_bits(f)); }
};

struct F32Rows {
  using T = float;
  static float load(T v) { return v; }
  static T store(float f) { return f; }
  static float round(float f) { return f; }
};

template <typename E>
void rotary_rows_of(typename E::T* xp, int64_t t, int64_t heads, int64_t d, int64_t st, int64_t sh,
                    const int64_t* pp, const typename E::T* cp, const typename E::T* sp) {
  using T = typename E::T;
  const int64_t half = d / 2;
  at::parallel_for(0, t, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* c = cp + pp[i] * d;
      const T* s = sp + pp[i] * d;
      for (int64_t hh = 0; hh < heads; ++hh) {
        T* v = xp + i * st + hh * sh;
#pragma omp simd
        for (int64_t j = 0; j < half; ++j) {
          const float a = E::load(v[j]), b = E::load(v[j + half]);
          const float lo = E::round(a * E::load(c[j])) + E::round(-b * E::load(s[j]));
          const float hi = E::round(b * E::load(c[j + half])) + E::round(a * E::load(s[j + half]));
          v[j] = E::store(lo);
          v[j + half] = E::store(hi);
        }
      }
    }
  });
}

void rotary_rows(uint16_t* xp, int64_t t, int64_t heads, int64_t d, int64_t st, int64_t sh, const int64_t* pp,
                 const uint16_t* cp, const uint16_t* sp) {
  rotary_rows_of<Bf16Rows>(xp, t, heads, d, st, sh, pp, cp, sp);
}

void rotary_rows_f32(float* xp, int64_t t, int64_t heads, int64_t d, int64_t st, int64_t sh, const int64_t* pp,
                     const float* cp, const float* sp) {
  rotary_rows_of<F32Rows>(xp, t, heads, d, st, sh, pp, cp, sp);
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
using tokenmill::Bf16Rows;
using tokenmill::F32Rows;
using tokenmill::rotary_rows_of;

template <typename E>
typename E::T* rows_of(const at::Tensor& x) {
  return reinterpret_cast<typename E::T*>(x.data_ptr());
}

void check_rows(const at::Tensor& x, const char* what) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, what,
              ": needs bfloat16 or float32");
  TORCH_CHECK(x.is_contiguous() && x.dim() == 2, what, ": needs a contiguous 2-D tensor");
}

void check_same_dtype(const at::Tensor& x, const at::Tensor& y, const char* what) {
  TORCH_CHECK(y.scalar_type() == x.scalar_type() && y.is_contiguous(), what, ": dtypes differ or not contiguous");
}

template <typename E>
void rms_norm_rows(const at::Tensor& x, const at::Tensor& weight, double eps, const c10::optional<at::Tensor>& residual,
                   at::Tensor& out) {
  using T = typename E::T;
  const int64_t rows = x.size(0), h = x.size(1);
  const T* xp = rows_of<E>(x);
  const T* wp = rows_of<E>(weight);
  T* rp = residual.has_value() ? rows_of<E>(*residual) : nullptr;
  T* op = rows_of<E>(out);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* src = xp + r * h;
      if (rp != nullptr) {
        T* res = rp + r * h;
#pragma omp simd
        for (int64_t i = 0; i < h; ++i) res[i] = E::store(E::load(src[i]) + E::load(res[i]));
        src = res;
      }
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < h; ++i) ss += E::load(src[i]) * E::load(src[i]);
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(h) + static_cast<float>(eps));
      T* o = op + r * h;
#pragma omp simd
      for (int64_t i = 0; i < h; ++i) o[i] = E::store(E::load(wp[i]) * E::round(E::load(src[i]) * inv));
    }
  });
}

// out = weight * round(x / rms(x)); with residual: residual = round(x + residual) first, in place,
// and the norm is taken of the new residual. Returns out.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                    const c10::optional<at::Tensor>& residual) {
  check_rows(x, "rms_norm");
  check_same_dtype(x, weight, "rms_norm weight");
  if (residual.has_value()) check_same_dtype(x, *residual, "rms_norm residual");
  auto out = at::empty_like(x);
  if (x.scalar_type() == at::kFloat) {
    rms_norm_rows<F32Rows>(x, weight, eps, residual, out);
  } else {
    rms_norm_rows<Bf16Rows>(x, weight, eps, residual, out);
  }
  return out;
}

template <typename E>
void silu_and_mul_rows(const at::Tensor& x, at::Tensor& out) {
  using T = typename E::T;
  const int64_t rows = x.size(0), inter = x.size(1) / 2;
  const T* xp = rows_of<E>(x);
  T* op = rows_of<E>(out);
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = xp + r * 2 * inter;
      const T* u = g + inter;
      T* o = op + r * inter;
#pragma omp simd
      for (int64_t i = 0; i < inter; ++i) {
        const float gv = E::load(g[i]);
        const float silu = E::round(gv / (1.f + exp_approx(-gv)));
        o[i] = E::store(silu * E::load(u[i]));
      }
    }
  });
}

// [T, 2I] -> [T, I]: round(silu(gate)) * up
at::Tensor silu_and_mul(const at::Tensor& x) {
  check_rows(x, "silu_and_mul");
  auto out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  if (x.scalar_type() == at::kFloat) {
    silu_and_mul_rows<F32Rows>(x, out);
  } else {
    silu_and_mul_rows<Bf16Rows>(x, out);
  }
  return out;
}

// In place on x [T, H, D] (any row stride): x = round(round(x * cos) + round(rotate_half(x) * sin)),
// cos/sin [P, D] of x's dtype indexed by positions [T].
void rotary_(at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK((x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat) && x.dim() == 3 && x.stride(2) == 1,
              "rotary: bad x");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type() && cos.is_contiguous() &&
                  sin.is_contiguous(), "rotary: cos/sin");
  auto pos = positions.contiguous();
  if (x.scalar_type() == at::kFloat) {
    tokenmill::rotary_rows_f32(x.data_ptr<float>(), x.size(0), x.size(1), x.size(2), x.stride(0), x.stride(1),
                               pos.data_ptr<int64_t>(), cos.data_ptr<float>(), sin.data_ptr<float>());
    return;
  }
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
