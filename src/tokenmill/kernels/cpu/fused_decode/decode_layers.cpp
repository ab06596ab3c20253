// The decoder layers of a Llama-family model (dense, or Mixtral's routed experts) for a pure-decode step,
// in one call.
//
// At batch 1 a step's weights stream at memory speed in the GEMV, but the Python layer loop spends a
// large share of the step between its many small kernel calls (module calls, views, dispatch; figures
// in bench/README.md, 'Measurements behind the code'). This op runs the same loop in C++ and calls the
// very same kernels (rms_norm, packed_gemv or oneDNN's packed linear as PackedLinear picks them,
// rotary_, write_kv_, paged_decode, silu_and_mul; the router's ATen ops), in the same order on the same
// data, so its output is bitwise the output of the Python loop; the Python loop stays the reference it
// is tested against. The
// GEMV and the attention block's kernels are called by their raw entry points (kernels.h), the rest
// through the dispatcher. Quantized projections (int8, int4, W8A8: attention's and a dense MLP's; routed experts
// are bf16 only) call the ops QuantizedLinearMethod.apply calls, with the same tensors (linear_kinds and quant say
// which and with what, four projection slots per layer, a sparse layer's MLP slots float); a quantized KV cache (int8,
// fp8 e4m3: kv_scales holds each layer's K and V scales) is written and read by the ops CpuBackend calls for it.
// Float32 rows (a float32 model: float projections, routed experts' included, and a float32 cache) take the same
// loop with the kernels' float32 forms; their projections are oneDNN's packed float32 product or, for bf16-stored
// weights, the panels' product (bf16p_gemm) or the widening GEMV (bf16w_gemv).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <immintrin.h>

#include <chrono>
#include <cstring>
#include <thread>
#include <type_traits>
#include <vector>

#include "kernels.h"

namespace {

using OptTensor = c10::optional<at::Tensor>;

template <typename Sig>
c10::TypedOperatorHandle<Sig> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

// the kernels' C++ signatures, as registered by the other kernel files
using T = const at::Tensor&;
using RmsNorm = at::Tensor(T, T, double, const OptTensor&);
using Gemv = at::Tensor(T, T, const OptTensor&);
using SiluAndMul = at::Tensor(T);
using ArgmaxRows = at::Tensor(T);
using Int8Linear = at::Tensor(T, T, T, T, const OptTensor&);
using Int4Linear = at::Tensor(T, T, T, T, int64_t, int64_t, const OptTensor&);
using W8A8Linear = at::Tensor(T, T, T, T, int64_t, const OptTensor&);
using WriteKvQuant = void(T, T, at::Tensor&, at::Tensor&, at::Tensor&, at::Tensor&, T);
using AttentionQuant = at::Tensor(T, T, T, T, T, T, T, double, int64_t);
using ArgmaxRowsMasked = at::Tensor(T, T);
using QuantizeRowsUint8 = std::tuple<at::Tensor, at::Tensor>(T);
using ScaleRows = at::Tensor(T, T, const OptTensor&, at::ScalarType);
using WidenedGemv = at::Tensor(T, T, const OptTensor&);

struct Ops {
  c10::TypedOperatorHandle<RmsNorm> rms_norm = find_op<RmsNorm>("tokenmill_cpu::rms_norm");
  c10::TypedOperatorHandle<Gemv> gemv = find_op<Gemv>("tokenmill_cpu::packed_gemv");
  c10::TypedOperatorHandle<SiluAndMul> silu_and_mul = find_op<SiluAndMul>("tokenmill_cpu::silu_and_mul");
  c10::TypedOperatorHandle<ArgmaxRows> argmax_rows = find_op<ArgmaxRows>("tokenmill_cpu::argmax_rows");
  c10::TypedOperatorHandle<Int8Linear> int8_linear = find_op<Int8Linear>("tokenmill_cpu::int8_linear");
  c10::TypedOperatorHandle<Int4Linear> int4_linear = find_op<Int4Linear>("tokenmill_cpu::int4_linear");
  c10::TypedOperatorHandle<W8A8Linear> w8a8_linear = find_op<W8A8Linear>("tokenmill_cpu::w8a8_linear");
  c10::TypedOperatorHandle<WriteKvQuant> write_kv_quant = find_op<WriteKvQuant>("tokenmill_cpu::write_kv_quant_");
  c10::TypedOperatorHandle<AttentionQuant> attention_quant =
      find_op<AttentionQuant>("tokenmill_cpu::paged_attention_quant");
  c10::TypedOperatorHandle<ArgmaxRowsMasked> argmax_rows_masked =
      find_op<ArgmaxRowsMasked>("tokenmill_cpu::argmax_rows_masked");
  c10::TypedOperatorHandle<QuantizeRowsUint8> quantize_rows_uint8 =
      find_op<QuantizeRowsUint8>("tokenmill_cpu::quantize_rows_uint8");
  c10::TypedOperatorHandle<ScaleRows> scale_rows = find_op<ScaleRows>("tokenmill_cpu::scale_rows");
  c10::TypedOperatorHandle<WidenedGemv> bf16w_gemv = find_op<WidenedGemv>("tokenmill_cpu::bf16w_gemv");
  c10::TypedOperatorHandle<WidenedGemv> bf16w_gemm = find_op<WidenedGemv>("tokenmill_cpu::bf16w_gemm");
  c10::TypedOperatorHandle<WidenedGemv> bf16p_gemm = find_op<WidenedGemv>("tokenmill_cpu::bf16p_gemm");
};

// product(rows) for rows [m, K] -> [m, N], run on rows padded with zero rows to oneDNN's row count
// (layers/linear.py's in_onednn_rows)
template <typename Product>
at::Tensor in_onednn_rows(const at::Tensor& x, Product&& product) {
  const int64_t m = x.size(0), padded = tokenmill::onednn_rows(m);
  if (padded == m) return product(x);
  return product(at::constant_pad_nd(x, {0, 0, 0, padded - m})).narrow(0, 0, m);
}

// w_ptr's marks for weights that are not a packed weight's address
constexpr int64_t kOneDnnOnly = -1;  // oneDNN packed this weight in a layout the GEMV does not read
constexpr int64_t kWidened = -2;     // a bf16-stored weight under float32 rows: bf16w_gemv, bf16w_gemm past its rows
constexpr int64_t kPanels = -3;      // a bf16 weight in bf16p_gemm's panels under float32 rows: that product

// PackedLinear.forward's choice: with gemv (the layer's GEMV is on), tokenmill's packed kernel for up to
// packed_gemv_max_rows(K) rows, else oneDNN on the same packed weight.
// w_ptr: the packed weight's address (PackedLinear.gemv_data_ptr), so the GEMV is called without the op's
// checks and mkldnn lookups, a fixed cost per call that counts at batch 1; 0: through the op; kOneDnnOnly:
// oneDNN always; kWidened: bf16w_gemv up to its rows and bf16w_gemm beyond, kPanels: bf16p_gemm, as
// UnquantizedLinearMethod.apply calls them
at::Tensor linear(const Ops& op, const at::Tensor& x, const at::Tensor& w, const OptTensor& bias, bool gemv,
                  int64_t w_ptr) {
  if (w_ptr == kWidened) {
    return x.size(0) <= tokenmill::bf16w_gemv_max_rows() ? op.bf16w_gemv.call(x, w, bias) : op.bf16w_gemm.call(x, w, bias);
  }
  if (w_ptr == kPanels) return op.bf16p_gemm.call(x, w, bias);
  if (gemv && w_ptr != kOneDnnOnly && x.size(0) <= tokenmill::packed_gemv_max_rows(w.size(1))) {
    if (w_ptr == 0) return op.gemv.call(x, w, bias);
    TORCH_CHECK(w.dim() == 2 && x.dim() == 2 && w.size(1) == x.size(1), "decode_layers: weight and x disagree on K");
    return tokenmill::packed_gemv_at(reinterpret_cast<const uint16_t*>(w_ptr), x, w.size(0), bias);
  }
  static const c10::OperatorHandle onednn =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  return in_onednn_rows(x, [&](const at::Tensor& rows) {
    torch::jit::Stack stack{rows, w, bias, c10::string_view("none"), c10::List<c10::optional<c10::Scalar>>(),
                            c10::string_view("")};
    onednn.callBoxed(&stack);
    return stack.at(0).toTensor();
  });
}

// A projection's kind in linear_kinds (kind, in_features, and int4's group or W8A8's most rows for its VNNI
// kernel per projection): what QuantizedLinearMethod.apply calls for it (kernels/cpu/linear/quantized.cpp),
// with scales and aux (int8, W8A8: the weight's row sums; int4: the zero points), and W8A8's oneDNN-packed
// weight and zero points (empty where it has none) from the quant list
enum Kind : int64_t { kFloat = 0, kInt8 = 1, kInt4 = 2, kW8A8 = 3 };
constexpr int64_t KIND_FIELDS = 3, QUANT_PER_PROJECTION = 4;

struct Projection {
  const int64_t* kind;    // null: every projection is a packed bf16 weight
  const at::Tensor* quant;  // scales, aux, oneDNN weight, oneDNN zero points
};

const Ops& ops() {
  static const Ops instance;  // looked up on first use, after every kernel file has registered
  return instance;
}

// W8A8 beyond its VNNI kernel's rows, as QuantizedLinearMethod.apply runs it: each row quantized (uint8, zero
// point 128), oneDNN's int8 matmul in its row counts, each row's scale after
at::Tensor w8a8_onednn(const Ops& op, const at::Tensor& x, const at::Tensor& scales, const at::Tensor& packed,
                       const at::Tensor& zeros, const OptTensor& bias) {
  static const c10::OperatorHandle qlinear =
      c10::Dispatcher::singleton().findSchemaOrThrow("onednn::qlinear_pointwise", "");
  const auto [xq, xs] = op.quantize_rows_uint8.call(x.contiguous());
  const at::Tensor dots = in_onednn_rows(xq, [&](const at::Tensor& rows) {
    torch::jit::Stack stack{rows, 1.0, tokenmill::kRowZeroPoint, packed, scales, zeros, c10::IValue(), 1.0, int64_t{0},
                            at::ScalarType::Float, c10::string_view("none"),
                            c10::List<c10::optional<c10::Scalar>>(), c10::string_view("")};
    qlinear.callBoxed(&stack);
    return stack.at(0).toTensor();
  });
  return op.scale_rows.call(dots, xs, bias, x.scalar_type());
}

at::Tensor project(const Ops& op, const at::Tensor& x, const at::Tensor& w, const OptTensor& bias, bool gemv,
                   int64_t w_ptr, const Projection& p) {
  switch (p.kind ? p.kind[0] : kFloat) {
    case kInt8: return op.int8_linear.call(x, w, p.quant[0], p.quant[1], bias);
    case kInt4: return op.int4_linear.call(x, w, p.quant[0], p.quant[1], p.kind[1], p.kind[2], bias);
    case kW8A8:
      if (x.size(0) > p.kind[2] && p.quant[2].numel() > 0) return w8a8_onednn(op, x, p.quant[0], p.quant[2],
                                                                               p.quant[3], bias);
      return op.w8a8_linear.call(x, w, p.quant[0], p.quant[1], p.kind[1], bias);
    default: return linear(op, x, w, bias, gemv, w_ptr);
  }
}


inline float bf16_to_float(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint16_t float_to_bf16(float f) { return c10::BFloat16(f).x; }  // round to nearest even, as at::to

constexpr int64_t PER_LAYER = 7;  // input norm, qkv, qkv bias (empty: none), o, post norm, gate_up, down
                                  // (gate_up and down empty: a sparse layer, its MLP the routed experts)

// How every sparse layer routes (layers.moe.route with softmax scores and the greedy top-k)
struct Routing {
  int64_t num_experts;  // 0: no sparse layer
  int64_t top_k;
  bool norm_topk_prob;
  double routed_scaling_factor;
};

// A sparse layer's routed experts, as layers.moe.SparseMoeBlock's fused path computes them with the same
// ops in the same order: router logits in float32, softmax, top-k, optional renormalisation and scaling;
// the (row, expert) pairs sorted by expert; each chosen expert runs once over its rows (experts nobody
// chose are not read) and its weighted output is added into its rows, experts in ascending order.
// ew: router [E, hidden] float32, E gate_up and E down weights; ep: their 2E GEMV addresses (or null)
at::Tensor routed_experts_row(const Ops& op, const at::Tensor& x, const at::Tensor& scores, const at::Tensor* ew,
                              const int64_t* ep, const Routing& r, bool gemv);

at::Tensor routed_experts(const Ops& op, const at::Tensor& x, const at::Tensor* ew, const int64_t* ep,
                          const Routing& r, bool gemv) {
  const int64_t e_count = r.num_experts, k = r.top_k;
  const at::Tensor scores = at::linear(x.to(at::kFloat), ew[0]).softmax(-1);
  if (x.size(0) == 1 && k <= 2) {
    return routed_experts_row(op, x, scores, ew, ep, r, gemv);
  }
  auto [weights, ids] = at::topk(scores, k, -1);
  if (r.norm_topk_prob) weights = weights / (weights.sum(-1, true) + 1e-20);
  weights = weights * r.routed_scaling_factor;
  const at::Tensor flat = ids.reshape(-1);
  const at::Tensor order = at::argsort(flat, /*stable=*/true, 0, false);
  const at::Tensor rows = at::floor_divide(order, k);
  const at::Tensor pair_weights = weights.reshape(-1).index_select(0, order).to(x.scalar_type());
  const at::Tensor counts = at::bincount(flat, {}, e_count);
  const int64_t* n = counts.data_ptr<int64_t>();
  at::Tensor out = at::zeros_like(x);
  for (int64_t e = 0, start = 0; e < e_count; ++e) {
    if (n[e] == 0) continue;
    const at::Tensor idx = rows.slice(0, start, start + n[e]);
    const at::Tensor gate_up = linear(op, x.index_select(0, idx), ew[1 + e], OptTensor(), gemv, ep ? ep[e] : 0);
    const at::Tensor y = linear(op, op.silu_and_mul.call(gate_up), ew[1 + e_count + e], OptTensor(), gemv,
                                ep ? ep[e_count + e] : 0);
    out.index_add_(0, idx, y * pair_weights.slice(0, start, start + n[e]).unsqueeze(1));
    start += n[e];
  }
  return out;
}

// the qkv bias slot holds an empty tensor where the model has none
OptTensor bias_or_none(const at::Tensor& t) { return t.numel() ? OptTensor(t) : OptTensor(); }

// h: the embedded input rows [T, hidden] (bf16 or float32); it becomes the residual stream, updated in place as in
// the Python loop. Returns the final norm of the last residual.
// One row with k <= 2 (bfloat16 or float32): routed_experts' arithmetic with plain loops where it calls an ATen op
// on k or E numbers (top-k, renormalisation, scaling, the pair weight in the rows' dtype, the weighted sum into
// zeros), each rounding as that op rounds (a sum of two floats has one rounding in any order), so only the
// router, its softmax and the k experts' kernels are calls.
at::Tensor routed_experts_row(const Ops& op, const at::Tensor& x, const at::Tensor& scores, const at::Tensor* ew,
                              const int64_t* ep, const Routing& r, bool gemv) {
  const int64_t e_count = r.num_experts, k = r.top_k, hidden = x.size(1);
  TORCH_CHECK(scores.is_contiguous() && scores.numel() == e_count, "decode_layers: router scores must be [1, E]");
  const float* s = scores.data_ptr<float>();
  int64_t ids[2] = {-1, -1};
  float w[2] = {0.f, 0.f};
  for (int64_t j = 0; j < k; ++j) {  // the k largest scores, best first (ties: the lower expert id)
    for (int64_t e = 0; e < e_count; ++e) {
      if ((j == 0 || e != ids[0]) && (ids[j] < 0 || s[e] > w[j])) ids[j] = e, w[j] = s[e];
    }
  }
  if (r.norm_topk_prob) {
    const float denom = (k == 2 ? w[0] + w[1] : w[0]) + static_cast<float>(1e-20);
    for (int64_t j = 0; j < k; ++j) w[j] = w[j] / denom;
  }
  const float scaling = static_cast<float>(r.routed_scaling_factor);
  int64_t order[2] = {0, 1};  // experts in ascending id, as the general path's sort by expert
  if (k == 2 && ids[1] < ids[0]) order[0] = 1, order[1] = 0;
  const bool f32 = x.scalar_type() == at::kFloat;
  at::Tensor out = at::zeros_like(x);
  for (int64_t j = 0; j < k; ++j) {
    const int64_t e = ids[order[j]];
    const at::Tensor gate_up = linear(op, x, ew[1 + e], OptTensor(), gemv, ep ? ep[e] : 0);
    at::Tensor y = linear(op, op.silu_and_mul.call(gate_up), ew[1 + e_count + e], OptTensor(), gemv,
                          ep ? ep[e_count + e] : 0);
    TORCH_CHECK(y.is_contiguous() && y.numel() == hidden, "decode_layers: an expert's output must be one row");
    if (f32) {
      const float pair_weight = w[order[j]] * scaling;
      float* yp = y.data_ptr<float>();
      float* acc = out.data_ptr<float>();
      // the product, then the sum, in two loops: as `y * pair_weight` and index_add_ round, never fused into
      // one multiply-add
      for (int64_t i = 0; i < hidden; ++i) yp[i] = yp[i] * pair_weight;
      for (int64_t i = 0; i < hidden; ++i) acc[i] = acc[i] + yp[i];
    } else {
      const float pair_weight = bf16_to_float(float_to_bf16(w[order[j]] * scaling));
      const auto* yp = reinterpret_cast<const uint16_t*>(y.data_ptr<at::BFloat16>());
      auto* acc = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
      for (int64_t i = 0; i < hidden; ++i) {
        const float weighted = bf16_to_float(float_to_bf16(bf16_to_float(yp[i]) * pair_weight));
        acc[i] = float_to_bf16(bf16_to_float(acc[i]) + weighted);
      }
    }
  }
  return out;
}

// rotary on q and k in place in qkv's t rows (q, then k, then v: qkv_row = q_size + 2 * kv_size elements a row), as
// the layer's rotary_ op does before its KV store. E: uint16_t (bf16) or float.
template <typename E>
void rotate_qk(E* q, const E* cos, const E* sin, const int64_t* pos, int64_t t, int64_t num_heads,
               int64_t num_kv_heads, int64_t head_dim) {
  const int64_t q_size = num_heads * head_dim, qkv_row = q_size + 2 * num_kv_heads * head_dim;
  if constexpr (std::is_same_v<E, float>) {
    tokenmill::rotary_rows_f32(q, t, num_heads, head_dim, qkv_row, head_dim, pos, cos, sin);
    tokenmill::rotary_rows_f32(q + q_size, t, num_kv_heads, head_dim, qkv_row, head_dim, pos, cos, sin);
  } else {
    tokenmill::rotary_rows(q, t, num_heads, head_dim, qkv_row, head_dim, pos, cos, sin);
    tokenmill::rotary_rows(q + q_size, t, num_kv_heads, head_dim, qkv_row, head_dim, pos, cos, sin);
  }
}

// the attention block of a layer over an unquantized cache, on raw pointers (decode_layers checked the tensors):
// rotary on q and k in qkv's rows (rotate_qk), k and v stored at their slots, decode attention into
// o [t, num_heads * head_dim]. E: uint16_t (bf16) or float.
template <typename E>
void attention_rows(E* q, const E* cos, const E* sin, const at::Tensor& cache, const int64_t* pos,
                    const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_lens, E* o,
                    int64_t t, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale,
                    int64_t window) {
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim, qkv_row = q_size + 2 * kv_size;
  E* k = q + q_size;
  const E* v = k + kv_size;
  E* k_cache = static_cast<E*>(cache.data_ptr());  // [2, blocks, block_size, kv heads, head_dim]: K, then V
  E* v_cache = k_cache + cache.stride(0);
  const int64_t block_size = cache.size(2), num_slots = cache.size(1) * block_size;
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const auto sc = static_cast<float>(scale);
  rotate_qk(q, cos, sin, pos, t, num_heads, num_kv_heads, head_dim);
  constexpr int64_t bytes = sizeof(E);
  tokenmill::write_kv_rows(reinterpret_cast<const char*>(k), reinterpret_cast<const char*>(v), qkv_row * bytes,
                           qkv_row * bytes, reinterpret_cast<char*>(k_cache), reinterpret_cast<char*>(v_cache),
                           slot_mapping.data_ptr<int64_t>(), t, kv_size * bytes, num_slots);
  if constexpr (std::is_same_v<E, float>) {
    tokenmill::paged_decode_f32(q, qkv_row, head_dim, k_cache, v_cache, tables, lens, o, t, num_heads, num_kv_heads,
                                head_dim, block_size, block_tables.size(1), sc, window);
  } else {
    tokenmill::paged_decode_bf16(q, qkv_row, head_dim, k_cache, v_cache, tables, lens, o, t, num_heads,
                                 num_kv_heads, head_dim, block_size, block_tables.size(1), sc, window);
  }
}

at::Tensor decode_layers(const at::Tensor& h_in, const at::Tensor& positions, const at::Tensor& cos,
                         const at::Tensor& sin, at::TensorList weights, const at::Tensor& gemv_ptrs,
                         const at::Tensor& final_norm, at::TensorList kv_caches, const at::Tensor& slot_mapping,
                         const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t num_heads,
                         int64_t num_kv_heads, int64_t head_dim, double eps, double scale, int64_t window,
                         bool gemv, at::TensorList quant, const at::Tensor& linear_kinds, at::TensorList kv_scales,
                         at::TensorList experts, const Routing& routing) {
  const int64_t layers = static_cast<int64_t>(kv_caches.size());
  TORCH_CHECK(kv_scales.empty() || static_cast<int64_t>(kv_scales.size()) == layers * 2,
              "decode_layers: kv_scales must be empty (bf16 caches) or K and V scales per layer");
  TORCH_CHECK(linear_kinds.numel() == 0 ||
                  (linear_kinds.scalar_type() == at::kLong && linear_kinds.is_contiguous() &&
                   linear_kinds.numel() == layers * 4 * KIND_FIELDS &&
                   static_cast<int64_t>(quant.size()) == layers * 4 * QUANT_PER_PROJECTION),
              "decode_layers: linear_kinds must be empty or int64 [layers * 4 * ", KIND_FIELDS, "] with ",
              QUANT_PER_PROJECTION, " quant tensors per projection");
  const int64_t* kinds = linear_kinds.numel() ? linear_kinds.data_ptr<int64_t>() : nullptr;
  // projection i of layer l (qkv, o, gate_up, down)
  auto proj = [&](int64_t l, int64_t i) {
    const int64_t at = l * 4 + i;
    return Projection{kinds ? kinds + at * KIND_FIELDS : nullptr,
                      kinds ? quant.data() + at * QUANT_PER_PROJECTION : nullptr};
  };
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * PER_LAYER, "decode_layers: ", PER_LAYER,
              " weights per layer expected");
  TORCH_CHECK(h_in.dim() == 2 && h_in.is_contiguous(), "decode_layers: h must be contiguous [T, hidden]");
  // GEMV addresses: qkv, o, then gate_up and down (a dense layer) or the E gate_ups and E downs (a sparse one)
  const int64_t per_expert_layer = 1 + 2 * routing.num_experts;
  int64_t sparse = 0;
  for (int64_t l = 0; l < layers; ++l) sparse += weights[l * PER_LAYER + 5].numel() == 0;
  TORCH_CHECK(static_cast<int64_t>(experts.size()) == sparse * per_expert_layer && (sparse == 0 || routing.top_k > 0),
              "decode_layers: router, gate_ups and downs of num_experts experts expected per sparse layer");
  TORCH_CHECK(gemv_ptrs.numel() == 0 ||
                  (gemv_ptrs.scalar_type() == at::kLong && gemv_ptrs.is_contiguous() &&
                   gemv_ptrs.numel() == (layers - sparse) * 4 + sparse * (2 + 2 * routing.num_experts)),
              "decode_layers: gemv_ptrs must be empty or int64 [one per projection]");
  const int64_t* wp = gemv_ptrs.numel() ? gemv_ptrs.data_ptr<int64_t>() : nullptr;
  const at::Tensor* ew = experts.data();  // the next sparse layer's router, gate_ups and downs
  const Ops& op = ops();
  const int64_t t = h_in.size(0), q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  const int64_t qkv_row = q_size + 2 * kv_size;
  // the attention block takes raw pointers (tokenmill::rotary_rows, write_kv_rows, paged_decode_bf16 and their
  // float32 forms, as the rotary_, write_kv_ and paged_decode ops do once they have checked their tensors):
  // checked here once
  const bool f32 = h_in.scalar_type() == at::kFloat;
  TORCH_CHECK(h_in.scalar_type() == at::kBFloat16 || f32, "decode_layers: bfloat16 or float32 rows only");
  TORCH_CHECK(!f32 || (!kinds && kv_scales.empty()),
              "decode_layers: float32 rows take float projections and a float32 cache only");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == t &&
              slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() && slot_mapping.numel() == t,
              "decode_layers: positions and slot_mapping must be contiguous int64 [T]");
  TORCH_CHECK(cos.scalar_type() == h_in.scalar_type() && sin.scalar_type() == h_in.scalar_type() &&
              cos.is_contiguous() && sin.is_contiguous() && cos.size(1) == head_dim,
              "decode_layers: cos/sin must be contiguous [P, head_dim] of the rows' dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() && block_tables.dim() == 2 &&
              block_tables.size(0) == t &&
              seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous() && seq_lens.numel() == t,
              "decode_layers: block_tables [T, max_blocks] and seq_lens [T] must be contiguous int32");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t max_pos = cos.size(0);
  for (int64_t i = 0; i < t; ++i) TORCH_CHECK(pos[i] >= 0 && pos[i] < max_pos, "decode_layers: position out of range");
  at::Tensor h = h_in, residual;
  at::Tensor o = at::empty({t, q_size}, h_in.options());  // each layer's attention output, in turn
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* w = weights.data() + l * PER_LAYER;
    const at::Tensor& cache = kv_caches[l];  // [2, blocks, block_size, kv heads, head_dim]
    const bool quantized_kv = !kv_scales.empty();
    TORCH_CHECK((quantized_kv || cache.scalar_type() == h_in.scalar_type()) && cache.is_contiguous() &&
                cache.dim() == 5 && cache.size(0) == 2 && cache.size(3) * cache.size(4) == kv_size,
                "decode_layers: each KV cache must be a contiguous [2, blocks, block_size, heads, head_dim], of the "
                "rows' dtype or with its scales");
    at::Tensor x;
    if (l == 0) {
      residual = h;
      x = op.rms_norm.call(h, w[0], eps, OptTensor());
    } else {
      x = op.rms_norm.call(h, w[0], eps, OptTensor(residual));
    }
    const int64_t* lp = wp;  // this layer's GEMV addresses
    const bool dense = w[5].numel() != 0;
    if (wp) wp += dense ? 4 : 2 + 2 * routing.num_experts;
    const at::Tensor qkv = project(op, x, w[1], bias_or_none(w[2]), gemv, lp ? lp[0] : 0, proj(l, 0));
    at::Tensor attn = o;
    if (f32) {
      attention_rows<float>(qkv.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), cache, pos,
                            slot_mapping, block_tables, seq_lens, o.data_ptr<float>(), t, num_heads, num_kv_heads,
                            head_dim, scale, window);
    } else if (quantized_kv) {
      // rotary as the layer applies it, then the quantized cache's store and attention, as CpuBackend.write_kv /
      // forward call them with the layer's KVScales: q, k, v are the same strided views of qkv that the layer's
      // split gives
      rotate_qk(reinterpret_cast<uint16_t*>(qkv.data_ptr<at::BFloat16>()),
                reinterpret_cast<const uint16_t*>(cos.data_ptr<at::BFloat16>()),
                reinterpret_cast<const uint16_t*>(sin.data_ptr<at::BFloat16>()), pos, t, num_heads, num_kv_heads,
                head_dim);
      const at::Tensor k_view = qkv.as_strided({t, num_kv_heads, head_dim}, {qkv_row, head_dim, 1}, q_size);
      const at::Tensor v_view = qkv.as_strided({t, num_kv_heads, head_dim}, {qkv_row, head_dim, 1}, q_size + kv_size);
      const at::Tensor q_view = qkv.as_strided({t, num_heads, head_dim}, {qkv_row, head_dim, 1}, 0);
      at::Tensor k_cache = cache[0], v_cache = cache[1], k_scales = kv_scales[2 * l], v_scales = kv_scales[2 * l + 1];
      op.write_kv_quant.call(k_view, v_view, k_cache, v_cache, k_scales, v_scales, slot_mapping);
      attn = op.attention_quant.call(q_view, k_cache, v_cache, k_scales, v_scales, block_tables, seq_lens, scale,
                                     window).view({t, q_size});
    } else {
      attention_rows<uint16_t>(reinterpret_cast<uint16_t*>(qkv.data_ptr<at::BFloat16>()),
                               reinterpret_cast<const uint16_t*>(cos.data_ptr<at::BFloat16>()),
                               reinterpret_cast<const uint16_t*>(sin.data_ptr<at::BFloat16>()), cache, pos,
                               slot_mapping, block_tables, seq_lens,
                               reinterpret_cast<uint16_t*>(o.data_ptr<at::BFloat16>()), t, num_heads, num_kv_heads,
                               head_dim, scale, window);
    }
    h = project(op, attn, w[3], OptTensor(), gemv, lp ? lp[1] : 0, proj(l, 1));
    x = op.rms_norm.call(h, w[4], eps, OptTensor(residual));
    if (dense) {
      const at::Tensor gate_up = project(op, x, w[5], OptTensor(), gemv, lp ? lp[2] : 0, proj(l, 2));
      h = project(op, op.silu_and_mul.call(gate_up), w[6], OptTensor(), gemv, lp ? lp[3] : 0, proj(l, 3));
    } else {
      h = routed_experts(op, x, ew, lp ? lp + 2 : nullptr, routing, gemv);
      ew += per_expert_layer;
    }
  }
  return op.rms_norm.call(h, final_norm, eps, OptTensor(residual));
}

at::Tensor decode_layers_op(const at::Tensor& h_in, const at::Tensor& positions, const at::Tensor& cos,
                            const at::Tensor& sin, at::TensorList weights, const at::Tensor& gemv_ptrs,
                            const at::Tensor& final_norm, at::TensorList kv_caches, const at::Tensor& slot_mapping,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t num_heads,
                            int64_t num_kv_heads, int64_t head_dim, double eps, double scale, int64_t window,
                            bool gemv, at::TensorList quant, const at::Tensor& linear_kinds,
                            at::TensorList kv_scales, at::TensorList experts, int64_t num_experts, int64_t top_k,
                            bool norm_topk_prob, double routed_scaling_factor) {
  return decode_layers(h_in, positions, cos, sin, weights, gemv_ptrs, final_norm, kv_caches, slot_mapping,
                       block_tables, seq_lens, num_heads, num_kv_heads, head_dim, eps, scale, window, gemv, quant,
                       linear_kinds, kv_scales, experts,
                       Routing{num_experts, top_k, norm_topk_prob, routed_scaling_factor});
}

constexpr auto kBitmaskWait = std::chrono::seconds(300);  // the longest a call waits for its bitmask

// until the int32 flag is set (release_flag, by the thread that writes the bitmask): spinning for the first
// 200 us, then yielding the CPU between looks; an error after kBitmaskWait (a fill that never ends)
void wait_for_flag(const at::Tensor& flag) {
  TORCH_CHECK(flag.scalar_type() == at::kInt && flag.numel() == 1 && flag.is_contiguous(),
              "bitmask_ready must be an int32 [1]");
  const int32_t* p = flag.data_ptr<int32_t>();
  const auto start = std::chrono::steady_clock::now();
  while (__atomic_load_n(p, __ATOMIC_ACQUIRE) == 0) {
    const auto waited = std::chrono::steady_clock::now() - start;
    TORCH_CHECK(waited < kBitmaskWait, "the step's token bitmask was not filled within ",
                std::chrono::duration_cast<std::chrono::seconds>(kBitmaskWait).count(), " s");
    if (waited < std::chrono::microseconds(200)) {
      _mm_pause();
    } else {
      std::this_thread::yield();
    }
  }
}

// sets an int32 [1] flag to 1 with release ordering: what this thread wrote before is visible to wait_for_flag's
void release_flag(const at::Tensor& flag) {
  TORCH_CHECK(flag.scalar_type() == at::kInt && flag.numel() == 1 && flag.is_contiguous(),
              "release_flag: the flag must be an int32 [1]");
  __atomic_store_n(flag.data_ptr<int32_t>(), 1, __ATOMIC_RELEASE);
}

// the final hidden states of a pure-decode step [T, hidden] -> each row's greedy token [T] (int64): lm_head and
// argmax (over the tokens each row's bitmask allows, where one is given); decode_greedy ends with it, and a step
// whose bitmasks were still being filled when it began calls it alone after decode_layers. With bitmask_ready the
// bitmask is being written by another thread: the argmax waits for that flag (after the lm_head). With
// lm_head_scales (and lm_head_wsum, its rows' sums) the lm_head is int8 [vocab, hidden], run by int8_linear as
// QuantizedLinearMethod.apply runs it
at::Tensor lm_head_greedy(const at::Tensor& x, const at::Tensor& lm_head, const OptTensor& lm_head_bias,
                          bool lm_head_gemv, int64_t lm_head_ptr, const OptTensor& lm_head_scales,
                          const OptTensor& lm_head_wsum, const OptTensor& bitmask, const OptTensor& bitmask_ready) {
  TORCH_CHECK(lm_head_scales.has_value() == lm_head_wsum.has_value(), "lm_head_greedy: an int8 lm_head needs its "
              "scales and row sums");
  const at::Tensor logits = lm_head_scales.has_value()
      ? ops().int8_linear.call(x, lm_head, *lm_head_scales, *lm_head_wsum, lm_head_bias)
      : linear(ops(), x, lm_head, lm_head_bias, lm_head_gemv, lm_head_ptr);
  if (bitmask_ready.has_value()) {
    TORCH_CHECK(bitmask.has_value(), "bitmask_ready without a bitmask");
    wait_for_flag(*bitmask_ready);
  }
  if (bitmask.has_value()) return ops().argmax_rows_masked.call(logits, *bitmask);
  return ops().argmax_rows.call(logits);
}

// input_ids [T] (int64) -> each row's greedy token [T] (int64): embedding, decode_layers, lm_head, argmax
// (over the tokens each row's bitmask allows, where one is given: structured output)
at::Tensor decode_greedy(const at::Tensor& input_ids, const at::Tensor& embed, const at::Tensor& positions,
                         const at::Tensor& cos, const at::Tensor& sin, at::TensorList weights,
                         const at::Tensor& gemv_ptrs, const at::Tensor& final_norm, at::TensorList kv_caches,
                         const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale,
                         int64_t window, bool gemv, at::TensorList quant, const at::Tensor& linear_kinds,
                         at::TensorList kv_scales, at::TensorList experts, int64_t num_experts, int64_t top_k,
                         bool norm_topk_prob, double routed_scaling_factor, const at::Tensor& lm_head,
                         const OptTensor& lm_head_bias, bool lm_head_gemv, int64_t lm_head_ptr,
                         const OptTensor& lm_head_scales, const OptTensor& lm_head_wsum, const OptTensor& bitmask,
                         const OptTensor& bitmask_ready) {
  // the embedding's rows, copied as at::embedding copies them (and widened to float32 rows from a bf16 table,
  // as layers.linear.Embedding does), without those ops' per-call overhead; the rows take cos's dtype. A tied
  // lm_head's bf16 panels ([vocab / 16, hidden, 16], layers.linear.bf16_panels) are read as that table
  // (layers.linear.embedding_rows).
  TORCH_CHECK(input_ids.scalar_type() == at::kLong && input_ids.is_contiguous() && input_ids.dim() == 1,
              "decode_greedy: input_ids must be contiguous int64 [T]");
  const bool widen = embed.scalar_type() == at::kBFloat16 && cos.scalar_type() == at::kFloat;
  const bool panels = widen && embed.dim() == 3 && embed.size(2) == 16;
  TORCH_CHECK((embed.scalar_type() == cos.scalar_type() || widen) && embed.is_contiguous() &&
                  (embed.dim() == 2 || panels),
              "decode_greedy: the embedding must be a contiguous [vocab, hidden] of the rows' dtype, or bfloat16 "
              "(as loaded or in panels) under float32 rows");
  const int64_t t = input_ids.size(0), vocab = embed.size(0) * (panels ? 16 : 1), hidden = embed.size(1);
  at::Tensor h = at::empty({t, hidden}, embed.options().dtype(cos.scalar_type()));
  const int64_t* ids = input_ids.data_ptr<int64_t>();
  const int64_t row_bytes = hidden * static_cast<int64_t>(embed.element_size());
  for (int64_t i = 0; i < t; ++i) {
    TORCH_CHECK(ids[i] >= 0 && ids[i] < vocab, "decode_greedy: token id ", ids[i], " out of range");
    if (panels) {  // column ids[i] of its panel: 32-bit word (id % 8), the high half for id % 16 >= 8
      const int64_t id = ids[i], slot = (id % 8) * 2 + (id % 16) / 8;
      const auto* bits = reinterpret_cast<const uint16_t*>(embed.data_ptr()) + (id / 16) * hidden * 16 + slot;
      float* dst = h.data_ptr<float>() + i * hidden;
      for (int64_t j = 0; j < hidden; ++j) dst[j] = bf16_to_float(bits[j * 16]);
      continue;
    }
    const char* src = static_cast<const char*>(embed.data_ptr()) + ids[i] * row_bytes;
    if (widen) {
      const auto* bits = reinterpret_cast<const uint16_t*>(src);
      float* dst = h.data_ptr<float>() + i * hidden;
      for (int64_t j = 0; j < hidden; ++j) dst[j] = bf16_to_float(bits[j]);
    } else {
      std::memcpy(static_cast<char*>(h.data_ptr()) + i * row_bytes, src, row_bytes);
    }
  }
  const at::Tensor x = decode_layers(h, positions, cos, sin, weights, gemv_ptrs, final_norm, kv_caches,
                                     slot_mapping, block_tables, seq_lens, num_heads, num_kv_heads, head_dim, eps,
                                     scale, window, gemv, quant, linear_kinds, kv_scales, experts,
                                     Routing{num_experts, top_k, norm_topk_prob, routed_scaling_factor});
  return lm_head_greedy(x, lm_head, lm_head_bias, lm_head_gemv, lm_head_ptr, lm_head_scales, lm_head_wsum, bitmask,
                        bitmask_ready);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def("decode_layers(Tensor(a!) h, Tensor positions, Tensor cos, Tensor sin, Tensor[] weights, Tensor gemv_ptrs, "
        "Tensor final_norm, Tensor(b!)[] kv_caches, Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, "
        "int num_heads, int num_kv_heads, int head_dim, float eps, float scale, int window, bool gemv, "
        "Tensor[] quant, Tensor linear_kinds, Tensor(c!)[] kv_scales, "
        "Tensor[] experts, int num_experts, int top_k, bool norm_topk_prob, float routed_scaling_factor) -> Tensor");
  m.def("decode_greedy(Tensor input_ids, Tensor embed, Tensor positions, Tensor cos, Tensor sin, Tensor[] weights, "
        "Tensor gemv_ptrs, Tensor final_norm, Tensor(b!)[] kv_caches, Tensor slot_mapping, Tensor block_tables, "
        "Tensor seq_lens, int num_heads, int num_kv_heads, int head_dim, float eps, float scale, int window, "
        "bool gemv, Tensor[] quant, Tensor linear_kinds, Tensor(c!)[] kv_scales, "
        "Tensor[] experts, int num_experts, int top_k, bool norm_topk_prob, float routed_scaling_factor, "
        "Tensor lm_head, Tensor? lm_head_bias, bool lm_head_gemv, int lm_head_ptr, Tensor? lm_head_scales, "
        "Tensor? lm_head_wsum, Tensor? bitmask=None, Tensor? bitmask_ready=None) -> Tensor");
  m.def("lm_head_greedy(Tensor x, Tensor lm_head, Tensor? lm_head_bias, bool lm_head_gemv, int lm_head_ptr, "
        "Tensor? lm_head_scales, Tensor? lm_head_wsum, Tensor? bitmask=None, Tensor? bitmask_ready=None) -> Tensor");
  m.def("release_flag(Tensor(a!) flag) -> ()");
}

// the packed weights are opaque oneDNN tensors, so calls dispatch on MkldnnCPU as well
TORCH_LIBRARY_IMPL(tokenmill_cpu, CPU, m) {
  m.impl("decode_layers", &decode_layers_op);
  m.impl("decode_greedy", &decode_greedy);
  m.impl("lm_head_greedy", &lm_head_greedy);
  m.impl("release_flag", &release_flag);
}
TORCH_LIBRARY_IMPL(tokenmill_cpu, MkldnnCPU, m) {
  m.impl("decode_layers", &decode_layers_op);
  m.impl("decode_greedy", &decode_greedy);
  m.impl("lm_head_greedy", &lm_head_greedy);
}
