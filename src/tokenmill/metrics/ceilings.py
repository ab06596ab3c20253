"""The ceilings MBU and MFU divide by, read from the roofline cache that `tokenmill bench roofline`
writes (~/.cache/tokenmill/roofline.json, $TOKENMILL_CACHE_DIR overrides), or given (--bandwidth,
--flops); and the one rule by which every MBU/MFU is taken against them: a measurement above its
ceiling proves the ceiling wrong, so the ceiling is raised to it (utilization 1) and that is said.

The cache holds, per cpu, device and thread count, `mem_read_GBps` (the best of a streaming read
kernel, torch's sum and a bf16 matvec) and `peak_bf16_gflops` / `peak_fp32_gflops` (the best of
register-blocked AVX-512 FMA / VDPBF16PS / AMX TDPBF16PS loops and torch's matmul)."""

from __future__ import annotations

import platform
from dataclasses import dataclass
from typing import Any

from tokenmill.user_cache import cache_file, read_json

# the figures a cache entry must have to be used (older entries, measured with torch alone, lack them)
CEILING_FIELDS = ("mem_read_GBps", "peak_bf16_gflops", "peak_fp32_gflops")


def cpu_name() -> str:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return cpu


CACHE_FILE = "roofline.json"


def cache_path() -> str:
    """roofline.json in the user cache directory (user_cache.cache_dir)."""
    return cache_file(CACHE_FILE)


def read_cache() -> dict[str, Any]:
    return read_json(CACHE_FILE)


def cache_key(threads: int, device: str = "cpu") -> str:
    return f"{cpu_name()}|{device}|threads={threads}"


def _usable(entry: Any, fields: tuple[str, ...]) -> bool:
    return isinstance(entry, dict) and all(isinstance(entry.get(k), (int, float)) for k in fields)


def lookup(threads: int, device: str = "cpu", fields: tuple[str, ...] = CEILING_FIELDS) -> dict[str, float] | None:
    hit = read_cache().get(cache_key(threads, device))
    if hit is None or not _usable(hit, fields):
        return None
    return {k: float(v) for k, v in hit.items() if isinstance(v, (int, float))}


def best_cached(device: str = "cpu", fields: tuple[str, ...] = CEILING_FIELDS) -> tuple[dict[str, float], int] | None:
    """The cached figures of this cpu/device with the highest mem_read_GBps, and their thread count."""
    prefix = f"{cpu_name()}|{device}|threads="
    found = [(v, int(k[len(prefix):])) for k, v in read_cache().items() if k.startswith(prefix) and _usable(v, fields)]
    if not found:
        return None
    figures, threads = max(found, key=lambda item: float(item[0]["mem_read_GBps"]))
    return {k: float(v) for k, v in figures.items() if isinstance(v, (int, float))}, threads


def flops_field(dtype: str) -> str:
    return "peak_fp32_gflops" if dtype == "float32" else "peak_bf16_gflops"


@dataclass(frozen=True)
class Ceilings:
    """The bandwidth and compute rate MBU/MFU are measured against, and where each came from."""

    bandwidth_gbps: float | None
    gflops: float | None
    bandwidth_source: str
    flops_source: str


def from_figures(dtype: str, figures: dict[str, float] | None, source: str, bandwidth: float | None = None,
                 flops: float | None = None) -> Ceilings:
    """Given figures win over the cache entry's; `flops` is the peak of `dtype`."""
    key = flops_field(dtype)
    return Ceilings(
        bandwidth_gbps=bandwidth if bandwidth is not None else (figures or {}).get("mem_read_GBps"),
        gflops=flops if flops is not None else (figures or {}).get(key),
        bandwidth_source="given" if bandwidth is not None else (f"{source}: mem_read_GBps" if figures else "none"),
        flops_source="given" if flops is not None else (f"{source}: {key}" if figures else "none"),
    )


def cached_ceilings(dtype: str, bandwidth: float | None = None, flops: float | None = None, threads: int | None = None,
                    device: str = "cpu") -> tuple[Ceilings, bool]:
    """The ceilings from the given figures, else the cache (this thread count, or the best cached one);
    and whether anything was missing (a bench may then measure)."""
    figures, source = None, "none"
    if bandwidth is None or flops is None:
        if threads is not None:
            figures, source = lookup(threads, device), f"cache (threads={threads})"
        else:
            found = best_cached(device)
            if found is not None:
                figures, source = found[0], f"cache (threads={found[1]})"
    c = from_figures(dtype, figures, source, bandwidth, flops)
    return c, c.bandwidth_gbps is None or c.gflops is None


@dataclass(frozen=True)
class Utilization:
    """achieved / ceiling, never above 1: an achieved rate above the ceiling raises the ceiling to it."""

    ratio: float
    ceiling: float
    raised: bool


def utilization(achieved: float, ceiling: float) -> Utilization:
    if achieved > ceiling:
        return Utilization(1.0, achieved, True)
    return Utilization(achieved / ceiling, ceiling, False)
