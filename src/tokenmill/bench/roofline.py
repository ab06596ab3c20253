"""`tokenmill bench roofline`: this machine's ceilings for MBU/MFU, once per thread count, measured with
kernels that reach them (kernels/cpu/roofline/peak.cpp) beside torch's figures (the anchors kit's
roofline.py method, same field names):

  mem_read_stream_GBps  a streaming read of a --gib GiB array, 8 independent 512-bit accumulators
  mem_read_torch_GBps   torch sum over the same fp32 array
  mem_copy_GBps         copy of half that array into another (bytes read + written)
  matvec_bf16_GBps      decode-shaped bf16 linear, batch 1, 256 MiB of weights
  mem_read_GBps         the read ceiling: the best of the three reads above
  peak_fp32_avx512_gflops, peak_fp32_avx2_gflops, peak_bf16_avx512_gflops, peak_bf16_amx_gflops
                        register-blocked VFMADD (512- and 256-bit) / VDPBF16PS / AMX TDPBF16PS loops, no
                        memory operands
                        (0 where the CPU or the compiler lacks the instructions)
  matmul_{fp32,bf16}_gflops  torch n x n matmul, 2*n^3 flops
  peak_{fp32,bf16}_gflops    the compute ceilings: the best of the loops and torch's matmul of the dtype

Rates are the best of --reps. Top-level fields are the best over the thread counts; `per_threads`
keeps each count. Measurements are cached (metrics/ceilings.py: the file, the key and the rule that
a rate observed above its ceiling raises the ceiling), so the benches, `tokenmill plan` and the
server's /metrics reuse them without measuring again.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from tokenmill.bench.results import ResultSink, emit, machine
from tokenmill.config import default_num_threads
from tokenmill.cpu_features import isa_flags
from tokenmill.metrics.ceilings import (
    CACHE_FILE,
    CEILING_FIELDS,
    Ceilings,
    cache_key,
    cache_path,
    cached_ceilings,
    from_figures,
    lookup,
    read_cache,
)
from tokenmill.user_cache import write_json

# (field, roofline_peak kind) of each peak loop
PEAK_LOOPS = (("peak_fp32_avx512_gflops", "avx512_fp32"), ("peak_fp32_avx2_gflops", "avx2_fp32"),
              ("peak_bf16_avx512_gflops", "avx512_bf16"), ("peak_bf16_amx_gflops", "amx_bf16"))
FIELDS = ("mem_read_GBps", "mem_read_stream_GBps", "mem_read_torch_GBps", "mem_copy_GBps", "matvec_bf16_GBps",
          "peak_fp32_gflops", "peak_bf16_gflops", *(field for field, _ in PEAK_LOOPS), "matmul_fp32_gflops",
          "matmul_bf16_gflops")
PEAK_LOOP_S = 0.2  # each timed peak loop runs about this long


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", default=None, help="comma-separated thread counts (default: 1 and all cores)")
    p.add_argument("--gib", type=float, default=2.0, help="size of the fp32 array streamed for the reads")
    p.add_argument("--n", type=int, default=2048, help="matmul size n (n x n @ n x n)")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--no-cache", dest="use_cache", action="store_false",
                   help="measure again even if a cached measurement exists (the new one is still saved)")


def add_ceiling_args(p: argparse.ArgumentParser) -> None:
    """The flags by which a bench gets the ceilings its MBU and MFU divide by (see ceilings())."""
    p.add_argument("--bandwidth", type=float, default=None, help="memory bandwidth in GB/s (else measured/cached)")
    p.add_argument("--flops", type=float, default=None,
                   help="peak GFLOP/s of the dtype (else measured/cached)")
    p.add_argument("--no-roofline", dest="roofline", action="store_false",
                   help="never measure the roofline; MBU/MFU only from --bandwidth/--flops or the cache")


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def best(fn: Callable[[], object], reps: int, device: str = "cpu") -> float:
    """Fastest of `reps` timed calls, after one untimed call."""
    fn()
    _sync(device)
    times = []
    for _ in range(max(1, reps)):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return min(times)


def probe_peak(threads: int) -> float | None:
    """The best of the peak loops' GFLOP/s at `threads` threads now (about a second), or None without the C++
    kernels: set beside the cached peak, it says whether the host gave the run its cores' arithmetic (a shared
    host's vCPUs may share a core's FMA units with other work)."""
    best = max(kernel_peaks(threads, 3).values(), default=0.0)
    return round(best, 1) if best > 0 else None


def kernel_peaks(threads: int, reps: int) -> dict[str, float]:
    """GFLOP/s of the peak loops at `threads` threads, each calibrated to run about PEAK_LOOP_S; 0 for a
    loop not built here (or with no C++ kernels at all)."""
    from tokenmill.kernels import load_cpu_kernels

    ops = load_cpu_kernels()
    out = {}
    for field, kind in PEAK_LOOPS:
        rate = 0.0
        if ops is not None:
            t0 = time.perf_counter()
            if float(ops.roofline_peak(kind, 20_000, threads)) > 0:
                iters = max(20_000, int(20_000 * PEAK_LOOP_S / (time.perf_counter() - t0)))
                rate = max(float(ops.roofline_peak(kind, iters, threads)) for _ in range(max(1, min(reps, 3))))
        out[field] = rate / 1e9
    return out


def stream_read(a: Any, threads: int, reps: int) -> float:
    """GB/s of the streaming read kernel over `a` (0 without the C++ kernels)."""
    from tokenmill.kernels import load_cpu_kernels

    ops = load_cpu_kernels()
    if ops is None:
        return 0.0
    return max(float(ops.roofline_stream_read(a, threads)) for _ in range(max(1, reps))) / 1e9


def measure(threads: int, gib: float = 2.0, n: int = 2048, reps: int = 7, device: str = "cpu") -> dict[str, float]:
    """One thread count's figures (GB/s, GFLOP/s), rounded to 0.1."""
    import torch

    if device == "cpu":
        torch.set_num_threads(threads)
    a = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32, device=device)
    half = a[: a.numel() // 2]
    b = torch.empty_like(half)
    r = {"mem_read_torch_GBps": a.nbytes / best(a.sum, reps, device) / 1e9,
         "mem_copy_GBps": 2 * b.nbytes / best(partial(b.copy_, half), reps, device) / 1e9,
         "mem_read_stream_GBps": stream_read(a, threads, reps) if device == "cpu" else 0.0}
    del a, half, b
    w = torch.randn(8192, 16384, device=device).to(torch.bfloat16)  # 256 MiB of weights, batch of one
    x = torch.randn(1, 16384, device=device).to(torch.bfloat16)
    r["matvec_bf16_GBps"] = w.nbytes / best(partial(torch.nn.functional.linear, x, w), reps, device) / 1e9
    del w, x
    for name, dtype in (("matmul_fp32_gflops", torch.float32), ("matmul_bf16_gflops", torch.bfloat16)):
        m1, m2 = torch.randn(n, n, device=device).to(dtype), torch.randn(n, n, device=device).to(dtype)
        r[name] = 2 * n**3 / best(partial(torch.matmul, m1, m2), 3, device) / 1e9
    r.update(kernel_peaks(threads, reps) if device == "cpu" else
             dict.fromkeys((field for field, _ in PEAK_LOOPS), 0.0))
    r["mem_read_GBps"] = max(r["mem_read_stream_GBps"], r["mem_read_torch_GBps"], r["matvec_bf16_GBps"])
    r["peak_fp32_gflops"] = max(r["peak_fp32_avx512_gflops"], r["peak_fp32_avx2_gflops"], r["matmul_fp32_gflops"])
    r["peak_bf16_gflops"] = max(r["peak_bf16_avx512_gflops"], r["peak_bf16_amx_gflops"], r["matmul_bf16_gflops"])
    return {k: round(v, 1) for k, v in r.items()}


def cached_measure(threads: int, gib: float = 2.0, n: int = 2048, reps: int = 7, device: str = "cpu",
                   use_cache: bool = True) -> tuple[dict[str, float], bool]:
    """(figures, came_from_cache) for one thread count; a fresh measurement is saved."""
    hit = lookup(threads, device, FIELDS) if use_cache else None
    if hit is not None:
        return {k: hit[k] for k in FIELDS}, True
    figures = measure(threads, gib, n, reps, device)
    cache = read_cache()
    cache[cache_key(threads, device)] = {**figures, "gib": gib, "n": n, "reps": reps, "loadavg": os.getloadavg()[0],
                                         "measured": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    try:
        write_json(CACHE_FILE, cache, indent=2)
    except OSError:
        pass  # a read-only home only costs a re-measurement next time
    return figures, False


def ceilings(dtype: str, bandwidth: float | None = None, flops: float | None = None, threads: int | None = None,
             measure_missing: bool = False, device: str = "cpu") -> Ceilings:
    """Given figures win; otherwise the cache (this thread count, or the best cached one); otherwise
    a measurement if `measure_missing`, else None. `flops` is the peak rate of `dtype`."""
    c, missing = cached_ceilings(dtype, bandwidth, flops, threads, device)
    if missing and measure_missing and (bandwidth is None or flops is None):
        t = threads or default_num_threads()
        c = from_figures(dtype, cached_measure(t, device=device)[0], f"measured (threads={t})", bandwidth, flops)
    return c


def thread_counts(spec: str | None) -> list[int]:
    if spec is None:
        return sorted({1, default_num_threads()})
    try:
        counts = [int(t) for t in spec.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"--threads {spec!r} is not a comma-separated list of integers") from None
    if not counts or min(counts) < 1:
        raise ValueError(f"--threads {spec!r}: thread counts must be >= 1")
    return counts


def run(args: argparse.Namespace) -> int:
    import torch

    if args.gib <= 0 or args.n < 1 or args.reps < 1:
        raise ValueError("--gib, --n and --reps must be positive")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda asked for, but torch sees no CUDA GPU")
    counts = [1] if args.device == "cuda" else thread_counts(args.threads)
    per: dict[str, dict[str, float]] = {}
    cached: dict[str, bool] = {}
    for t in counts:
        per[str(t)], cached[str(t)] = cached_measure(t, args.gib, args.n, args.reps, args.device, args.use_cache)
    result: dict[str, Any] = {"engine": "tokenmill", "bench": "roofline", "device": args.device,
                              "cpu": machine()["cpu"], "cores": os.cpu_count(), "torch": torch.__version__,
                              "isa": isa_flags(), "loadavg": round(os.getloadavg()[0], 2)}
    if args.device == "cuda":
        result["gpu"] = torch.cuda.get_device_name()
    for key in FIELDS:
        result[key] = max(v[key] for v in per.values())
    result.update({"per_threads": per, "cached": cached, "gib": args.gib, "n": args.n, "reps": args.reps,
                   "cache_file": cache_path()})
    emit(result, ResultSink.from_args(args))
    return 0


__all__ = ["CEILING_FIELDS", "FIELDS", "Ceilings", "add_args", "add_ceiling_args", "cached_measure", "ceilings",
           "measure", "run"]
