// The decoder layers of a Llama-family model for a pure-decode step, in one call.
//
// At batch 1 a step's weights stream at memory speed in the GEMV, but Python spent ~1 ms per step
// between the ~90 kernel calls of the layer loop (module calls, views, dispatch): about a sixth of
// the step. This op runs the same loop in C++ and calls the very same kernels through the
// dispatcher (rms_norm, packed_gemv or oneDNN's packed linear as PackedLinear picks them, rotary_,
// write_kv_, paged_decode, silu_and_mul), in the same order on the same tensors, so its output is
// bitwise the output of the Python loop; the Python loop stays the reference it is tested against.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <vector>

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
using Rotary = void(at::Tensor&, T, T, T);
using WriteKv = void(T, T, at::Tensor&, at::Tensor&, T);
using PagedDecode = at::Tensor(T, T, T, T, T, double, int64_t);
using SiluAndMul = at::Tensor(T);
using ArgmaxRows = at::Tensor(T);

struct Ops {
  c10::TypedOperatorHandle<RmsNorm> rms_norm = find_op<RmsNorm>("tokenmill_cpu::rms_norm");
  c10::TypedOperatorHandle<Gemv> gemv = find_op<Gemv>("tokenmill_cpu::packed_gemv");
  c10::TypedOperatorHandle<Rotary> rotary = find_op<Rotary>("tokenmill_cpu::rotary_");
  c10::TypedOperatorHandle<WriteKv> write_kv = find_op<WriteKv>("tokenmill_cpu::write_kv_");
  c10::TypedOperatorHandle<PagedDecode> decode = find_op<PagedDecode>("tokenmill_cpu::paged_decode");
  c10::TypedOperatorHandle<SiluAndMul> silu_and_mul = find_op<SiluAndMul>("tokenmill_cpu::silu_and_mul");
  c10::TypedOperatorHandle<ArgmaxRows> argmax_rows = find_op<ArgmaxRows>("tokenmill_cpu::argmax_rows");
};

// PackedLinear.forward's choice: tokenmill's GEMV up to gemv_rows rows, else oneDNN on the same packed weight
at::Tensor linear(const Ops& op, const at::Tensor& x, const at::Tensor& w, const OptTensor& bias, int64_t gemv_rows) {
  if (x.size(0) <= gemv_rows) return op.gemv.call(x, w, bias);
  static const c10::OperatorHandle onednn =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, w, bias, c10::string_view("none"), c10::List<c10::optional<c10::Scalar>>(),
                          c10::string_view("")};
  onednn.callBoxed(&stack);
  return stack.at(0).toTensor();
}

const Ops& ops() {
  static const Ops instance;  // looked up on first use, after every kernel file has registered
  return instance;
}

constexpr int64_t PER_LAYER = 7;  // input norm, qkv, qkv bias (empty: none), o, post norm, gate_up, down

// the qkv bias slot holds an empty tensor where the model has none
OptTensor bias_or_none(const at::Tensor& t) { return t.numel() ? OptTensor(t) : OptTensor(); }

// h: the embedded input rows [T, hidden] (bf16); it becomes the residual stream, updated in place as in
// the Python loop. Returns the final norm of the last residual.
at::Tensor decode_layers(const at::Tensor& h_in, const at::Tensor& positions, const at::Tensor& cos,
                         const at::Tensor& sin, at::TensorList weights, const at::Tensor& final_norm,
                         at::TensorList kv_caches, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                         const at::Tensor& seq_lens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                         double eps, double scale, int64_t window, int64_t gemv_rows) {
  const int64_t layers = static_cast<int64_t>(kv_caches.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * PER_LAYER, "decode_layers: ", PER_LAYER,
              " weights per layer expected");
  TORCH_CHECK(h_in.dim() == 2 && h_in.is_contiguous(), "decode_layers: h must be contiguous [T, hidden]");
  const Ops& op = ops();
  const int64_t t = h_in.size(0), q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  at::Tensor h = h_in, residual;
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* w = weights.data() + l * PER_LAYER;
    at::Tensor x;
    if (l == 0) {
      residual = h;
      x = op.rms_norm.call(h, w[0], eps, OptTensor());
    } else {
      x = op.rms_norm.call(h, w[0], eps, OptTensor(residual));
    }
    const at::Tensor qkv = linear(op, x, w[1], bias_or_none(w[2]), gemv_rows);
    at::Tensor q = qkv.narrow(1, 0, q_size).view({t, num_heads, head_dim});
    at::Tensor k = qkv.narrow(1, q_size, kv_size).view({t, num_kv_heads, head_dim});
    const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({t, num_kv_heads, head_dim});
    op.rotary.call(q, positions, cos, sin);
    op.rotary.call(k, positions, cos, sin);
    at::Tensor k_cache = kv_caches[l].select(0, 0), v_cache = kv_caches[l].select(0, 1);
    op.write_kv.call(k, v, k_cache, v_cache, slot_mapping);
    const at::Tensor o = op.decode.call(q, k_cache, v_cache, block_tables, seq_lens, scale, window);
    h = linear(op, o.view({t, q_size}), w[3], OptTensor(), gemv_rows);
    x = op.rms_norm.call(h, w[4], eps, OptTensor(residual));
    h = linear(op, op.silu_and_mul.call(linear(op, x, w[5], OptTensor(), gemv_rows)), w[6], OptTensor(), gemv_rows);
  }
  return op.rms_norm.call(h, final_norm, eps, OptTensor(residual));
}

// input_ids [T] (int64) -> each row's greedy token [T] (int64): embedding, decode_layers, lm_head, argmax
at::Tensor decode_greedy(const at::Tensor& input_ids, const at::Tensor& embed, const at::Tensor& positions,
                         const at::Tensor& cos, const at::Tensor& sin, at::TensorList weights,
                         const at::Tensor& final_norm, at::TensorList kv_caches, const at::Tensor& slot_mapping,
                         const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t num_heads,
                         int64_t num_kv_heads, int64_t head_dim, double eps, double scale, int64_t window,
                         int64_t gemv_rows, const at::Tensor& lm_head, const OptTensor& lm_head_bias,
                         int64_t lm_head_gemv_rows) {
  const at::Tensor h = at::embedding(embed, input_ids);
  const at::Tensor x = decode_layers(h, positions, cos, sin, weights, final_norm, kv_caches, slot_mapping,
                                     block_tables, seq_lens, num_heads, num_kv_heads, head_dim, eps, scale, window,
                                     gemv_rows);
  return ops().argmax_rows.call(linear(ops(), x, lm_head, lm_head_bias, lm_head_gemv_rows));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def("decode_layers(Tensor(a!) h, Tensor positions, Tensor cos, Tensor sin, Tensor[] weights, Tensor final_norm, "
        "Tensor(b!)[] kv_caches, Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, int num_heads, "
        "int num_kv_heads, int head_dim, float eps, float scale, int window, int gemv_rows) -> Tensor");
  m.def("decode_greedy(Tensor input_ids, Tensor embed, Tensor positions, Tensor cos, Tensor sin, Tensor[] weights, "
        "Tensor final_norm, Tensor(b!)[] kv_caches, Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, "
        "int num_heads, int num_kv_heads, int head_dim, float eps, float scale, int window, int gemv_rows, "
        "Tensor lm_head, Tensor? lm_head_bias, int lm_head_gemv_rows) -> Tensor");
}

// the packed weights are opaque oneDNN tensors, so calls dispatch on MkldnnCPU as well
TORCH_LIBRARY_IMPL(tokenmill_cpu, CPU, m) {
  m.impl("decode_layers", &decode_layers);
  m.impl("decode_greedy", &decode_greedy);
}
TORCH_LIBRARY_IMPL(tokenmill_cpu, MkldnnCPU, m) {
  m.impl("decode_layers", &decode_layers);
  m.impl("decode_greedy", &decode_greedy);
}
