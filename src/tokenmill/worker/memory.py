"""Host memory for the CPU worker: the KV pool as lazily faulted zero pages, and an allocator
that keeps freed activation memory instead of returning it to the OS every step."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import mmap

import torch

logger = logging.getLogger(__name__)

# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling on 64-bit


def zeros_lazily(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor. On CPU it is an anonymous mapping: zero pages the OS faults in as blocks are
    first written, so start-up neither touches nor commits the whole budget. The mapping asks for
    transparent huge pages: with 4 KiB pages every first write of a KV block page-faults, which
    cost ~5% of an offline run. (Zeros matter: padded attention reads of never-written slots
    must not meet NaN garbage.)"""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.finfo(dtype).bits // 8
    buf = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel without THP: 4 KiB pages
            pass
    return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)


def keep_freed_memory() -> bool:
    """Serve a step's activations (up to 32 MiB each) from the heap and never trim it: with glibc's
    defaults, blocks over 128 KiB are mmap'd and unmapped per tensor, so every step page-faults
    its activations in again (~100k faults per offline run of 64 requests here). Process-wide,
    so it is called in the worker's process only; a no-op off glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = libc.mallopt if libc is not None else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:
        return False
    ok = all(mallopt(param, value) == 1 for param, value in (
        (_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX), (_M_TRIM_THRESHOLD, 1 << 30), (_M_TOP_PAD, 64 << 20)))
    if not ok:
        logger.info("mallopt refused a setting; activations may be page-faulted in every step")
    return ok
