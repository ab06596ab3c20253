// A bf16 weight [N, K] written in oneDNN's AB16b64a2b layout (gemv.cpp's packed layout: blocks of 64 outputs,
// each holding all of K as chunks of 32 k, a chunk being 16 k-pairs x 64 outputs x 2; N padded to 64 and K to 32
// with zeros), by threads that each write whole output blocks, and the oneDNN tensor that reads those bytes.
// oneDNN's own reorder (mkldnn::_reorder_linear_weight) produces the same bytes; tokenmill.layers.linear compares
// the two once per shape before it uses this packer, and keeps oneDNN's reorder where they differ. Also
// tokenmill::onednn_buffer, through which gemv.cpp reads a packed weight's bytes.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <utility>

#include "kernels.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace at::native {
// exported by libtorch_cpu (ATen/native/mkldnn/MKLDNNCommon.h, whose ideep headers torch does not ship): an
// opaque oneDNN tensor of the serialized memory descriptor over data_ptr, which it does not own. Weak: a torch
// without it leaves the address null (has_onednn_over), and the library still loads.
TORCH_API at::Tensor mkldnn_tensor_from_data_ptr(void* data_ptr, at::IntArrayRef dims, at::ScalarType dtype,
                                                 at::Device device, const uint8_t* opaque_metadata,
                                                 int64_t opaque_metadata_size) __attribute__((weak));
}  // namespace at::native

namespace {

constexpr int64_t kBlockN = tokenmill::kPackedBlockN, kBlockK = tokenmill::kPackedBlockK, kPairs = kBlockK / 2;

constexpr int64_t padded(int64_t n, int64_t block) { return (n + block - 1) / block * block; }

// one 64 x 32 chunk whose rows and k all lie inside the weight: k-pairs moved as 32-bit words, dst[p][n] = src[n][p]
void chunk_full(const uint16_t* src, int64_t ld, uint32_t* dst) {
#if defined(__AVX512F__)
  // 16 rows at a time: a 16 x 16 transpose of 32-bit words in registers
  for (int64_t n0 = 0; n0 < kBlockN; n0 += 16) {
    __m512i t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
      const __m512i a = _mm512_loadu_si512(src + (n0 + i) * ld), b = _mm512_loadu_si512(src + (n0 + i + 1) * ld);
      t[i] = _mm512_unpacklo_epi32(a, b);
      t[i + 1] = _mm512_unpackhi_epi32(a, b);
    }
    // u[4g + j], 128-bit lane L: the words of pair 4L + j of rows n0 + 4g .. n0 + 4g + 3
    for (int g = 0; g < 4; ++g) {
      u[4 * g + 0] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
      u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
      u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
      u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
    }
    for (int j = 0; j < 4; ++j) {
      const __m512i v0 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x88), w0 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xdd);
      const __m512i v1 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x88);
      const __m512i w1 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xdd);
      _mm512_storeu_si512(dst + (0 + j) * kBlockN + n0, _mm512_shuffle_i32x4(v0, v1, 0x88));
      _mm512_storeu_si512(dst + (4 + j) * kBlockN + n0, _mm512_shuffle_i32x4(w0, w1, 0x88));
      _mm512_storeu_si512(dst + (8 + j) * kBlockN + n0, _mm512_shuffle_i32x4(v0, v1, 0xdd));
      _mm512_storeu_si512(dst + (12 + j) * kBlockN + n0, _mm512_shuffle_i32x4(w0, w1, 0xdd));
    }
  }
#else
  for (int64_t n = 0; n < kBlockN; ++n) {
    uint32_t row[kPairs];
    std::memcpy(row, src + n * ld, sizeof(row));
    for (int64_t p = 0; p < kPairs; ++p) dst[p * kBlockN + n] = row[p];
  }
#endif
}

// a chunk at the weight's edge (rows past N or k past K): those elements are zero
void chunk_edge(const uint16_t* src, int64_t ld, int64_t rows, int64_t ks, uint16_t* dst) {
  std::memset(dst, 0, kBlockN * kBlockK * sizeof(uint16_t));
  for (int64_t n = 0; n < rows; ++n)
    for (int64_t k = 0; k < ks; ++k) dst[(k / 2) * kBlockN * 2 + n * 2 + (k & 1)] = src[n * ld + k];
}

// weight [N, K] bf16, contiguous -> its AB16b64a2b bytes as a flat bf16 tensor of padded(N) * padded(K) elements
at::Tensor pack_ab16b64a2b(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.is_contiguous() &&
                  weight.device().is_cpu(),
              "pack_ab16b64a2b: the weight must be a contiguous 2-D bfloat16 CPU tensor");
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t Np = padded(N, kBlockN), Kp = padded(K, kBlockK);
  at::Tensor out = at::empty({Np * Kp}, weight.options());
  const auto* src = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  auto* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  // each thread writes (and so first touches) whole 64-output blocks
  at::parallel_for(0, Np / kBlockN, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * kBlockN, rows = std::min(kBlockN, N - n0);
      for (int64_t k0 = 0; k0 < Kp; k0 += kBlockK) {
        const int64_t ks = std::min(kBlockK, K - k0);
        uint16_t* chunk = dst + n0 * Kp + k0 * kBlockN;
        if (rows == kBlockN && ks == kBlockK && K % 2 == 0)
          chunk_full(src + n0 * K + k0, K, reinterpret_cast<uint32_t*>(chunk));
        else
          chunk_edge(src + n0 * K + k0, K, rows, ks, chunk);
      }
    }
  });
  return out;
}

bool has_onednn_over() { return &at::native::mkldnn_tensor_from_data_ptr != nullptr; }

// the opaque oneDNN tensor [N, K] of `metadata` (mkldnn::_get_mkldnn_serialized_md of a tensor in this layout)
// over storage's bytes. It does not own them: the caller keeps `storage` alive for as long as the result is used.
at::Tensor onednn_over(const at::Tensor& storage, at::IntArrayRef sizes, const at::Tensor& metadata) {
  TORCH_CHECK(storage.is_contiguous() && storage.device().is_cpu() && storage.scalar_type() == at::kBFloat16,
              "onednn_over: storage must be a contiguous bfloat16 CPU tensor");
  TORCH_CHECK(metadata.scalar_type() == at::kByte && metadata.is_contiguous(),
              "onednn_over: metadata must be contiguous uint8");
  TORCH_CHECK(has_onednn_over(), "onednn_over: this torch does not export mkldnn_tensor_from_data_ptr");
  at::Tensor t = at::native::mkldnn_tensor_from_data_ptr(storage.data_ptr(), sizes, at::kBFloat16, storage.device(),
                                                         metadata.data_ptr<uint8_t>(), metadata.numel());
  const int64_t bytes = tokenmill::onednn_buffer(t).second;
  TORCH_CHECK(bytes == storage.numel() * 2, "onednn_over: the descriptor spans ", bytes, " bytes, the storage holds ",
              storage.numel() * 2);
  return t;
}

// whether an opaque oneDNN tensor's bytes equal storage's
bool onednn_bytes_equal(const at::Tensor& packed, const at::Tensor& storage) {
  TORCH_CHECK(packed.is_mkldnn() && storage.is_contiguous(), "onednn_bytes_equal: an opaque and a dense tensor");
  const auto [data, n] = tokenmill::onednn_buffer(packed);
  return n == storage.numel() * storage.element_size() && std::memcmp(data, storage.data_ptr(), n) == 0;
}

}  // namespace

std::pair<void*, int64_t> tokenmill::onednn_buffer(const at::Tensor& t) {
  static auto data_ptr = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::data_ptr", "")
                             .typed<int64_t(const at::Tensor&)>();
  static auto nbytes = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_nbytes", "")
                           .typed<int64_t(const at::Tensor&)>();
  return {reinterpret_cast<void*>(data_ptr.call(t)), nbytes.call(t)};
}

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def("pack_ab16b64a2b(Tensor weight) -> Tensor", &pack_ab16b64a2b);
  m.def("has_onednn_over() -> bool", &has_onednn_over);
  m.def("onednn_over(Tensor storage, int[] sizes, Tensor metadata) -> Tensor", &onednn_over);
  m.def("onednn_bytes_equal(Tensor packed, Tensor storage) -> bool", &onednn_bytes_equal);
}
