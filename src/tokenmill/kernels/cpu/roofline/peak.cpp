// The machine's ceilings for MBU and MFU (`tokenmill bench roofline`), measured with loops that reach
// them: register-blocked FMA / bf16 dot-product / AMX tile loops with no memory operands for the
// compute peak, and a streaming read with independent accumulators for the read bandwidth.
// Each op runs on `threads` OpenMP threads and returns the rate over the whole parallel region
// (FLOP/s or bytes/s), or 0 where the instructions are not built or not usable on this CPU.
#include <ATen/ATen.h>
#include <cpuid.h>
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <torch/library.h>
#include <unistd.h>

#include "kernels.h"

#include <chrono>
#include <cstdint>
#include <string>

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

constexpr int kChains = 16;  // independent accumulators: more than latency x issue ports of an FMA unit

// C independent chains acc = step(acc), iters rounds from zeros, in registers; returns the sum of every lane of
// every chain, so that the loop is not dead code. V: a GCC vector of floats (__m256, __m512).
template <typename V, int C, typename Step>
float chains(int64_t iters, Step step) {
  V acc[C];
  for (auto& a : acc) a = V{};
  for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) acc[c] = step(acc[c]);
  }
  V s = acc[0];
  for (int c = 1; c < C; ++c) s += acc[c];
  float sum = 0.0f;
  for (int l = 0; l < static_cast<int>(sizeof(V) / sizeof(float)); ++l) sum += s[l];
  return sum;
}

#ifdef __AVX512F__
// 32 FLOPs per vfmadd (16 lanes x mul + add)
float fp32_fma_loop(int64_t iters) {
  const __m512 x = _mm512_set1_ps(1.0f), y = _mm512_set1_ps(1e-7f);
  return chains<__m512, kChains>(iters, [&](__m512 a) { return _mm512_fmadd_ps(a, x, y); });
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
constexpr int kChainsAvx2 = 12;  // of the 16 ymm registers, with the two operands: still more than latency x ports

// 16 FLOPs per 256-bit vfmadd (8 lanes x mul + add)
float fp32_fma_avx2_loop(int64_t iters) {
  const __m256 x = _mm256_set1_ps(1.0f), y = _mm256_set1_ps(1e-7f);
  return chains<__m256, kChainsAvx2>(iters, [&](__m256 a) { return _mm256_fmadd_ps(a, x, y); });
}
#endif

#ifdef __AVX512BF16__
// 64 FLOPs per vdpbf16ps (16 lanes x 2 bf16 products, each mul + add)
float bf16_dot_loop(int64_t iters) {
  const __m512bh x = (__m512bh)_mm512_set1_epi16(0x3f80);  // bf16 1.0
  const __m512bh y = (__m512bh)_mm512_set1_epi16(0x3380);  // bf16 ~6e-8
  return chains<__m512, kChains>(iters, [&](__m512 a) { return _mm512_dpbf16_ps(a, x, y); });
}
#endif

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
// 16384 FLOPs per tdpbf16ps (16 x 16 fp32 outputs, each a 32-deep bf16 dot product); four
// accumulator tiles over two A and two B tiles, as a GEMM micro-kernel holds them
float amx_bf16_loop(int64_t iters) {
  tokenmill::AmxTileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
  _tile_loadconfig(&cfg);
  alignas(64) uint16_t ab[16 * 32];
  for (auto& v : ab) v = 0x3380;
  alignas(64) float out[16 * 16];
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_loadd(4, ab, 64);
  _tile_loadd(5, ab, 64);
  _tile_loadd(6, ab, 64);
  _tile_loadd(7, ab, 64);
  for (int64_t i = 0; i < iters; ++i) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, out, 64);
  _tile_release();
  return out[0];
}
#endif

// flops per iteration of each loop, and the loop; nullptr where it is not built here
struct PeakLoop {
  double flops_per_iter;
  float (*loop)(int64_t);
};

PeakLoop peak_loop(const std::string& kind) {
#ifdef __AVX512F__
  if (kind == "avx512_fp32") return {32.0 * kChains, fp32_fma_loop};
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (kind == "avx2_fp32") return {16.0 * kChainsAvx2, fp32_fma_avx2_loop};
#endif
#ifdef __AVX512BF16__
  if (kind == "avx512_bf16") return {64.0 * kChains, bf16_dot_loop};
#endif
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
  if (kind == "amx_bf16") return {4 * 16384.0, amx_bf16_loop};
#endif
  TORCH_CHECK(kind == "avx512_fp32" || kind == "avx2_fp32" || kind == "avx512_bf16" || kind == "amx_bf16",
              "roofline_peak: unknown kind ", kind);
  return {0.0, nullptr};
}

double roofline_peak(std::string kind, int64_t iters, int64_t threads) {
  TORCH_CHECK(iters > 0 && threads > 0, "roofline_peak: iters and threads must be positive");
  const PeakLoop p = peak_loop(kind);
  if (p.loop == nullptr) return 0.0;
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
  if (kind == "amx_bf16" && !tokenmill::amx_bf16_permitted()) return 0.0;
#endif
  volatile float sink = 0.0f;
  double elapsed = 0.0;
#pragma omp parallel num_threads(threads)
  {
    p.loop(iters / 16 + 1);  // warm the unit up (AVX-512 and AMX start at a lower clock)
#pragma omp barrier
    const auto t0 = std::chrono::steady_clock::now();
    const float r = p.loop(iters);
#pragma omp barrier
#pragma omp master
    elapsed = seconds_since(t0);
#pragma omp critical
    sink = sink + r;
  }
  (void)sink;
  return p.flops_per_iter * static_cast<double>(iters) * static_cast<double>(threads) / elapsed;
}

// Reads buf (each thread a contiguous slice) with 8 independent 512-bit accumulators, 512 bytes an
// iteration; returns bytes/s over the whole pass, all threads together
double roofline_stream_read(const at::Tensor& buf, int64_t threads) {
  TORCH_CHECK(buf.is_contiguous() && buf.is_cpu(), "roofline_stream_read: needs a contiguous CPU tensor");
  TORCH_CHECK(threads > 0, "roofline_stream_read: threads must be positive");
  const int64_t nbytes = buf.numel() * buf.element_size();
  constexpr int64_t kStep = 512;
  const int64_t chunks = nbytes / kStep;
  TORCH_CHECK(chunks >= threads, "roofline_stream_read: buffer too small");
  const char* base = static_cast<const char*>(buf.data_ptr());
  TORCH_CHECK(reinterpret_cast<uintptr_t>(base) % 64 == 0, "roofline_stream_read: buffer not 64-byte aligned");
  volatile int64_t sink = 0;
  double elapsed = 0.0;
#pragma omp parallel num_threads(threads)
  {
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t lo = chunks * t / nt, hi = chunks * (t + 1) / nt;
#pragma omp barrier
    const auto t0 = std::chrono::steady_clock::now();
#ifdef __AVX512F__
    __m512i acc[8];
    for (auto& a : acc) a = _mm512_setzero_si512();
    for (int64_t c = lo; c < hi; ++c) {
      const char* p = base + c * kStep;
#pragma GCC unroll 8
      for (int k = 0; k < 8; ++k) acc[k] = _mm512_xor_si512(acc[k], _mm512_load_si512(p + 64 * k));
    }
    for (int k = 1; k < 8; ++k) acc[0] = _mm512_xor_si512(acc[0], acc[k]);
    const int64_t r = _mm512_reduce_add_epi64(acc[0]);
#else
    int64_t r = 0;
    const int64_t* q = reinterpret_cast<const int64_t*>(base);
    for (int64_t i = lo * (kStep / 8); i < hi * (kStep / 8); ++i) r ^= q[i];
#endif
#pragma omp barrier
#pragma omp master
    elapsed = seconds_since(t0);
#pragma omp critical
    sink = sink ^ r;
  }
  (void)sink;
  return static_cast<double>(chunks * kStep) / elapsed;
}

}  // namespace


bool tokenmill::amx_bf16_permitted() {
  static const bool permitted = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 22))) return false;  // AMX-BF16
    // Linux hands out the AMX tile state only on request
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return permitted;
}

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def("roofline_peak(str kind, int iters, int threads) -> float", &roofline_peak);
  m.def("roofline_stream_read(Tensor buf, int threads) -> float", &roofline_stream_read);
}
