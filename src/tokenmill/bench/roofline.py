"""`tokenmill bench roofline`: this machine's ceilings for MBU/MFU, measured with torch the same way
(and with the same field names) as the anchors kit's roofline.py, once per thread count:

  mem_read_GBps     sum over a --gib GiB fp32 array (a pure streaming read)        best of --reps
  mem_copy_GBps     copy of half that array into another (bytes read + written)   best of --reps
  matvec_bf16_GBps  decode-shaped bf16 linear, batch 1, 256 MiB of weights        best of --reps
  matmul_{fp32,bf16}_gflops  n x n matmul, 2*n^3 flops                            best of 3

Top-level fields are the best over the thread counts; `per_threads` keeps each count. Measurements
are cached in ~/.cache/tokenmill/roofline.json ($TOKENMILL_CACHE_DIR overrides) keyed by cpu, device
and thread count, so the latency bench and `tokenmill plan` reuse them without measuring again.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from tokenmill.bench.results import ResultSink, emit, machine
from tokenmill.config import default_num_threads

FIELDS = ("mem_read_GBps", "mem_copy_GBps", "matvec_bf16_GBps", "matmul_fp32_gflops", "matmul_bf16_gflops")
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", default=None, help="comma-separated thread counts (default: 1 and all cores)")
    p.add_argument("--gib", type=float, default=2.0, help="size of the fp32 array streamed for mem_read")
    p.add_argument("--n", type=int, default=2048, help="matmul size n (n x n @ n x n)")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--no-cache", dest="use_cache", action="store_false",
                   help="measure again even if a cached measurement exists (the new one is still saved)")


def add_ceiling_args(p: argparse.ArgumentParser) -> None:
    """The flags by which a bench gets the ceilings its MBU and MFU divide by (see ceilings())."""
    p.add_argument("--bandwidth", type=float, default=None, help="memory bandwidth in GB/s (else measured/cached)")
    p.add_argument("--flops", type=float, default=None, help="matmul GFLOP/s of the dtype (else measured/cached)")
    p.add_argument("--no-roofline", dest="roofline", action="store_false",
                   help="never measure the roofline; MBU/MFU only from --bandwidth/--flops or the cache")


def cache_path() -> str:
    """$TOKENMILL_CACHE_DIR/roofline.json, else ~/.cache/tokenmill/roofline.json (XDG_CACHE_HOME honoured)."""
    root = os.environ.get("TOKENMILL_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "tokenmill")
    return os.path.join(root, "roofline.json")


def _read_cache() -> dict[str, Any]:
    try:
        with open(cache_path(), encoding="utf-8") as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_cache(data: dict[str, Any]) -> None:
    path = cache_path()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
    os.replace(tmp, path)


def cache_key(threads: int, device: str = "cpu") -> str:
    return f"{machine()['cpu']}|{device}|threads={threads}"


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


def measure(threads: int, gib: float = 2.0, n: int = 2048, reps: int = 7, device: str = "cpu") -> dict[str, float]:
    """One thread count's figures (GB/s, GFLOP/s), rounded to 0.1."""
    import torch

    if device == "cpu":
        torch.set_num_threads(threads)
    a = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32, device=device)
    half = a[: a.numel() // 2]
    b = torch.empty_like(half)
    r = {"mem_read_GBps": a.nbytes / best(a.sum, reps, device) / 1e9,
         "mem_copy_GBps": 2 * b.nbytes / best(partial(b.copy_, half), reps, device) / 1e9}
    del a, half, b
    w = torch.randn(8192, 16384, device=device).to(torch.bfloat16)  # 256 MiB of weights, batch of one
    x = torch.randn(1, 16384, device=device).to(torch.bfloat16)
    r["matvec_bf16_GBps"] = w.nbytes / best(partial(torch.nn.functional.linear, x, w), reps, device) / 1e9
    del w, x
    for name, dtype in (("matmul_fp32_gflops", torch.float32), ("matmul_bf16_gflops", torch.bfloat16)):
        m1, m2 = torch.randn(n, n, device=device).to(dtype), torch.randn(n, n, device=device).to(dtype)
        r[name] = 2 * n**3 / best(partial(torch.matmul, m1, m2), 3, device) / 1e9
    return {k: round(v, 1) for k, v in r.items()}


def lookup(threads: int, device: str = "cpu") -> dict[str, float] | None:
    hit = _read_cache().get(cache_key(threads, device))
    if isinstance(hit, dict) and all(k in hit for k in FIELDS):
        return {k: float(hit[k]) for k in FIELDS}
    return None


def cached_measure(threads: int, gib: float = 2.0, n: int = 2048, reps: int = 7, device: str = "cpu",
                   use_cache: bool = True) -> tuple[dict[str, float], bool]:
    """(figures, came_from_cache) for one thread count; a fresh measurement is saved."""
    hit = lookup(threads, device) if use_cache else None
    if hit is not None:
        return hit, True
    figures = measure(threads, gib, n, reps, device)
    cache = _read_cache()
    cache[cache_key(threads, device)] = {**figures, "gib": gib, "n": n, "reps": reps, "loadavg": os.getloadavg()[0],
                                         "measured": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    try:
        _write_cache(cache)
    except OSError:
        pass  # a read-only home only costs a re-measurement next time
    return figures, False


def best_cached(device: str = "cpu") -> tuple[dict[str, float], int] | None:
    """The cached figures of this cpu/device with the highest mem_read_GBps, and their thread count."""
    prefix = f"{machine()['cpu']}|{device}|threads="
    found = [(v, int(k[len(prefix):])) for k, v in _read_cache().items()
             if k.startswith(prefix) and isinstance(v, dict) and all(f in v for f in FIELDS)]
    if not found:
        return None
    figures, threads = max(found, key=lambda item: float(item[0]["mem_read_GBps"]))
    return {k: float(figures[k]) for k in FIELDS}, threads


@dataclass(frozen=True)
class Ceilings:
    """The bandwidth and matmul rate MBU/MFU are measured against, and where each came from."""

    bandwidth_gbps: float | None
    gflops: float | None
    bandwidth_source: str
    flops_source: str


def ceilings(dtype: str, bandwidth: float | None = None, flops: float | None = None, threads: int | None = None,
             measure_missing: bool = False, device: str = "cpu") -> Ceilings:
    """Given figures win; otherwise the cache (this thread count, or the best cached one); otherwise
    a measurement if `measure_missing`, else None. `flops` is the matmul rate of `dtype`."""
    figures, source = None, "none"
    if bandwidth is None or flops is None:
        if threads is not None:
            figures, source = lookup(threads, device), f"cache (threads={threads})"
        else:
            found = best_cached(device)
            if found is not None:
                figures, source = found[0], f"cache (threads={found[1]})"
        if figures is None and measure_missing:
            t = threads or default_num_threads()
            figures, source = cached_measure(t, device=device)[0], f"measured (threads={t})"
    flops_key = "matmul_fp32_gflops" if dtype == "float32" else "matmul_bf16_gflops"
    return Ceilings(
        bandwidth_gbps=bandwidth if bandwidth is not None else (figures or {}).get("mem_read_GBps"),
        gflops=flops if flops is not None else (figures or {}).get(flops_key),
        bandwidth_source="given" if bandwidth is not None else (f"{source}: mem_read_GBps" if figures else "none"),
        flops_source="given" if flops is not None else (f"{source}: {flops_key}" if figures else "none"),
    )


def isa_flags() -> list[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), [])
    except OSError:
        flags = []
    return [f for f in ISA_FLAGS if f in flags]


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
