"""This CPU's feature flags as /proc/cpuinfo lists them, and what they allow (torch-free: config.py
resolves the default dtype with them, the layers pick their kernels)."""

from __future__ import annotations

import functools

# oneDNN's bf16 matmul runs on AVX-512 BW/VL/DQ (natively with AVX512-BF16 or AMX, else converting) or
# AVX-NE-CONVERT; without them (an AVX2-only CPU) torch's bf16 linear layers take a reference kernel
ONEDNN_BF16_FLAGS = frozenset({"avx512bw", "avx512vl", "avx512dq"})
# the flags that decide which kernels run here, as the benches' results and the roofline record them
ISA_FLAGS = ("avx2", "avx512f", "avx512bw", "avx512_bf16", "avx512_vnni", "amx_bf16", "avx_ne_convert")


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (empty where /proc/cpuinfo has no x86 flags line)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_runs_bf16() -> bool:
    """Whether bf16 linear layers run at oneDNN's speed here; True where the flags are unknown."""
    flags = cpu_flags()
    return not flags or ONEDNN_BF16_FLAGS <= flags or "avx_ne_convert" in flags


def isa_flags() -> list[str]:
    """The ISA_FLAGS this CPU has, in that order."""
    flags = cpu_flags()
    return [f for f in ISA_FLAGS if f in flags]
