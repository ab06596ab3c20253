"""Host memory for the CPU worker: the KV pool as lazily faulted zero pages, and an allocator
that keeps freed activation memory instead of returning it to the OS every step."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import ctypes.util
import logging
import math
import mmap
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch

logger = logging.getLogger(__name__)

# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling on 64-bit
_MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault pages in writable without touching their contents
_PAGE = mmap.PAGESIZE


def zeros_lazily(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor. On CPU it is an anonymous mapping: zero pages the OS faults in as blocks are
    first written, so start-up neither touches nor commits the whole budget. (Zeros matter: padded
    attention reads of never-written slots must not meet NaN garbage.)

    The mapping asks for transparent huge pages. That is a trade: decode attention reads the
    scattered KV blocks faster from 2 MiB pages (fewer TLB misses), but a first touch of memory that
    was never backed costs more per GiB in 2 MiB pages than in 4 KiB pages, so the first offline run
    right after start-up pays more in KV writes, about what the faster reads win back. Every later
    run, and a server (BackgroundPopulate faults the pool in while it is idle), gets the faster
    reads (figures in bench/README.md, 'Measurements behind the code')."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
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
    its activations in again. Process-wide, so it is called in the worker's process only, and after the
    model is loaded: a heap that never trims keeps every block freed before, such as the weights the
    load repacks. A no-op off glibc."""
    mallopt = _libc_function("mallopt")
    if mallopt is None:
        return False
    ok = all(mallopt(param, value) == 1 for param, value in (
        (_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX), (_M_TRIM_THRESHOLD, 1 << 30), (_M_TOP_PAD, 64 << 20)))
    if not ok:
        logger.info("mallopt refused a setting; activations may be page-faulted in every step")
    return ok


class BackgroundPopulate:
    """Faults a lazily mapped KV pool in from a background thread while the engine is idle, lowest
    block ids first (the pool hands those out first), so that KV writes stop paying first-touch
    page faults (a KV write to a fresh page waits for the kernel to fault it in) once the engine
    has had idle time; a run started right after start-up still pays them for the pages it uses.

    Idle only: a first touch costs kernel time for every GiB, populating beside a running step
    slows the step's matmuls, and beside start-up it delays `tokenmill serve`'s first token
    (bench/README.md, 'Measurements behind the code'). So the thread begins when the first step is
    over and then waits while steps run (`paused()` wraps each): it works between requests. It
    holds no GIL while the kernel populates (ctypes releases it). `kv` is contiguous with the block
    index at `block_dim`. On a non-Linux OS or a kernel before 5.14 it does nothing.

    A thread still running when the interpreter exits is stopped and joined by an atexit hook
    (`stop`): a daemon thread left running into finalization can abort the process ("terminate called
    without an active exception", exit code 134; bench/README.md, 'Measurements behind the code')."""

    def __init__(self, kv: torch.Tensor, block_dim: int, chunk_bytes: int = 2 << 20, quiet_s: float = 0.05) -> None:
        self._quiet_s = quiet_s
        self._busy_until = 0.0
        self._stop = threading.Event()
        self.thread: threading.Thread | None = None
        madvise = _libc_function("madvise")
        if madvise is None or kv.device.type != "cpu" or not kv.is_contiguous() or kv.numel() == 0:
            return
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        num_regions = math.prod(kv.shape[:block_dim])
        region_bytes = kv[(0,) * block_dim].numel() * kv.element_size()

        def run() -> None:  # the closure holds kv, so the mapping outlives the engine until done
            with contextlib.suppress(OSError, AttributeError):  # lowest priority: everything else comes first
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
            try:
                populate()
            finally:
                atexit.unregister(self.stop)

        def populate() -> None:
            base = kv.data_ptr()
            for start in range(0, region_bytes, chunk_bytes):
                length = min(chunk_bytes, region_bytes - start)
                for r in range(num_regions):
                    while time.monotonic() < self._busy_until and not self._stop.is_set():
                        time.sleep(self._quiet_s)
                    if self._stop.is_set():
                        return
                    addr = base + r * region_bytes + start
                    lo = addr - addr % _PAGE
                    if madvise(lo, addr + length - lo, _MADV_POPULATE_WRITE) != 0:
                        logger.debug("MADV_POPULATE_WRITE refused; KV pages fault in on first write")
                        return

        self.thread = threading.Thread(target=run, name="kv-populate", daemon=True)

    def start(self) -> BackgroundPopulate:
        """Begin now (paused() begins it after the first step otherwise)."""
        if self.thread is not None and self.thread.ident is None:
            atexit.register(self.stop)
            self.thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """End the thread at its next chunk (2 MiB of one region, or a pause's sleep) and wait for it."""
        self._stop.set()
        if self.thread is not None and self.thread.ident is not None:
            self.thread.join(timeout)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Run a step: the thread holds off during it and for `quiet_s` after it."""
        self._busy_until = math.inf
        try:
            yield
        finally:
            self._busy_until = time.monotonic() + self._quiet_s
            if self.thread is not None and self.thread.ident is None:
                self.start()


def _libc_function(name: str) -> Any | None:
    """A glibc function through ctypes (which drops the GIL for the call), or None off glibc."""
    libc_name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(libc_name), name) if libc_name else None
    except (OSError, AttributeError):
        return None
