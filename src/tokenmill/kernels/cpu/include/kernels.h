// Entry points of kernels that decode_layers calls directly, by raw pointers: at batch 1 the tensor
// views, checks and dispatch around each call cost more than some of the kernels themselves.
// The registered ops take tensors, check them and call these same functions.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <cstdint>
#include <utility>

namespace tokenmill {

// In place on t rows of heads x d bf16 values (row stride st, head stride sh, in elements):
// x = bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)), cos/sin [P, d] at positions pos[t]
void rotary_rows(uint16_t* x, int64_t t, int64_t heads, int64_t d, int64_t st, int64_t sh, const int64_t* pos,
                 const uint16_t* cos, const uint16_t* sin);
// the same on float32 rows (the rotary_ op's float32 form): x = x * cos + rotate_half(x) * sin
void rotary_rows_f32(float* x, int64_t t, int64_t heads, int64_t d, int64_t st, int64_t sh, const int64_t* pos,
                     const float* cos, const float* sin);

// Stores t rows of keys and values (row_bytes each, at row strides k_stride/v_stride bytes) at their cache
// slots (caches of num_slots slots of row_bytes); checks each slot is in range
void write_kv_rows(const char* k, const char* v, int64_t k_stride, int64_t v_stride, char* k_cache, char* v_cache,
                   const int64_t* slots, int64_t t, int64_t row_bytes, int64_t num_slots);

// decode attention of t bf16 query rows (row stride q_seq_stride, head stride q_head_stride) over the
// paged caches [blocks, bs, hk, dim] -> out [t, hq, dim]
void paged_decode_bf16(const uint16_t* q, int64_t q_seq_stride, int64_t q_head_stride, const uint16_t* kc,
                       const uint16_t* vc, const int32_t* tables, const int32_t* lens, uint16_t* out, int64_t t,
                       int64_t hq, int64_t hk, int64_t dim, int64_t bs, int64_t max_blocks, float scale,
                       int64_t window);
// the same over an fp8 e4m3 cache (the codes; float32 scales [slots, hk], value = code * scale), where it runs in
// bf16 products (AVX512-BF16, head size 64 or 128): false, and nothing written, elsewhere
bool paged_decode_fp8_bf16(const uint16_t* q, int64_t q_seq_stride, int64_t q_head_stride, const uint8_t* kc,
                           const uint8_t* vc, const float* ks, const float* vs, const int32_t* tables,
                           const int32_t* lens, uint16_t* out, int64_t t, int64_t hq, int64_t hk, int64_t dim,
                           int64_t bs, int64_t max_blocks, float scale, int64_t window);
// the same over float32 queries and caches (the paged_decode op's float32 form)
void paged_decode_f32(const float* q, int64_t q_seq_stride, int64_t q_head_stride, const float* kc, const float* vc,
                      const int32_t* tables, const int32_t* lens, float* out, int64_t t, int64_t hq, int64_t hk,
                      int64_t dim, int64_t bs, int64_t max_blocks, float scale, int64_t window);

// The offset quantized.cpp's W8A8 rows are stored with (q + 128, uint8): VNNI's u8 x s8 products take them so,
// and it is the source zero point of oneDNN's int8 matmul over quantize_rows_uint8's rows
constexpr int64_t kRowZeroPoint = 128;

// oneDNN's AB16b64a2b layout of a bf16 weight [N, K], which linear/gemv.cpp reads and linear/pack.cpp writes:
// blocks of kPackedBlockN outputs, each holding all of K as chunks of kPackedBlockK k (16 k-pairs x 64 outputs x 2)
constexpr int64_t kPackedBlockN = 64, kPackedBlockK = 32;
// bytes of a [N, K] bf16 weight packed by oneDNN as AB16b64a2b (N padded to 64, K to 32)
int64_t packed_gemv_bytes(int64_t N, int64_t K);
// the raw buffer of an opaque oneDNN tensor and its size in bytes, through the mkldnn ops torch registers for that
std::pair<void*, int64_t> onednn_buffer(const at::Tensor& t);

// The row count a oneDNN product of m rows runs with (layers/linear.py's onednn_rows, which says why): m up
// to 16, else m rounded up to a multiple of an eighth of the largest power of two below m
int64_t onednn_rows(int64_t m);
// The most rows of in_features columns for which packed_gemv_at is the kernel to use (beyond them,
// oneDNN's on the same packed weight is faster); 0 where it is not built
int64_t packed_gemv_max_rows(int64_t in_features);
// Whether this process may run AMX-BF16 instructions: the CPU has them (CPUID) and Linux granted the
// tile state (arch_prctl ARCH_REQ_XCOMP_PERM, once per process, as oneDNN asks too). roofline/peak.cpp.
bool amx_bf16_permitted();

// The AMX tile configuration ldtilecfg reads (palette 1): each tile's rows and bytes a row
struct alignas(64) AmxTileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// An int8 or int4 weight as quantized.cpp lays it out (one of w8, w4 set): int8 [N, K] with scale [N]; int4
// packed [N, Kp / 2] (runs of 32 k: byte j holds k = j low, k = j + 16 high) with scale and zero [N, groups]
// (zero null: 8 throughout)
struct QuantWeight {
  const int8_t* w8 = nullptr;
  const uint8_t* w4 = nullptr;
  const float* scale = nullptr;
  const float* zero = nullptr;
  int64_t N = 0, K = 0, Kp = 0;  // Kp: K padded to 32
  int64_t group = 0, groups = 1;  // int4
};
// Whether dequant_amx_linear is built and this process may run AMX-BF16
bool dequant_amx_available();
// x bf16 [M, K] (rows contiguous, any M) times q dequantized to bf16 block by block (AMX-BF16 tiles; no bf16
// copy of the whole weight), plus bias: [M, N] bf16. linear/dequant_amx.cpp. q is trusted (the ops check it).
at::Tensor dequant_amx_linear(const at::Tensor& x, const QuantWeight& q, const c10::optional<at::Tensor>& bias);

// The most rows the layers give bf16w_gemv (the widening GEMV over a bf16 [N, K] weight under float32 rows);
// past them they take bf16w_gemm. 0 where they are not built (no AVX2/FMA).
int64_t bf16w_gemv_max_rows();

// x [M, K] (any M, contiguous) times the packed [N, K] weight at w, plus bias [N]: [M, N]; all bf16.
// Checks x and bias; w is trusted (the op checks its packed size, decode_layers gets it from
// PackedLinear.gemv_data_ptr, which does)
at::Tensor packed_gemv_at(const uint16_t* w, const at::Tensor& x, int64_t N, const c10::optional<at::Tensor>& bias);

}  // namespace tokenmill
