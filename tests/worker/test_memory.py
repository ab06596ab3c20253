"""The CPU worker's host memory helpers."""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import mmap
import sys
import time

import pytest
import torch

from tokenmill.worker.memory import BackgroundPopulate, keep_freed_memory, zeros_lazily


def test_zeros_lazily_is_a_writable_zero_tensor() -> None:
    t = zeros_lazily((3, 5, 16, 2, 8), torch.bfloat16, torch.device("cpu"))
    assert t.shape == (3, 5, 16, 2, 8) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert not t.any()
    t[1, 2] = 7
    assert int(t.float().sum()) == 7 * 16 * 2 * 8


def test_keep_freed_memory_applies_on_glibc() -> None:
    if sys.platform.startswith("linux"):  # glibc here; elsewhere it must simply not fail
        assert keep_freed_memory()
    else:
        keep_freed_memory()


linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE, mincore: Linux")


def _pool(shape: tuple[int, ...], block_dim: int, quiet_s: float = 0.05) -> tuple[torch.Tensor, BackgroundPopulate]:
    """A lazily mapped pool and its (not yet started) populate thread, in 64 KiB chunks."""
    t = zeros_lazily(shape, torch.bfloat16, torch.device("cpu"))
    pop = BackgroundPopulate(t, block_dim=block_dim, chunk_bytes=1 << 16, quiet_s=quiet_s)
    assert pop.thread is not None
    return t, pop


@linux_only
def test_background_populate_faults_the_pool_in_without_changing_it() -> None:
    t, pop = _pool((2, 2, 300, 16, 2, 8), block_dim=2)  # regions of 300 blocks, not page-aligned per region
    t[1, 0, 7] = 3
    assert _resident_fraction(t) < 0.5
    assert pop.start().thread is not None
    pop.thread.join(timeout=30)
    assert not pop.thread.is_alive()
    assert _resident_fraction(t) == 1.0
    assert int(t.float().sum()) == 3 * 16 * 2 * 8  # the contents are untouched


@linux_only
def test_background_populate_waits_while_a_step_runs() -> None:
    t, pop = _pool((4, 2048, 16, 2, 8), block_dim=1, quiet_s=0.2)  # 8 MiB
    assert pop.thread is not None
    with pop.paused():
        pop.start()
        time.sleep(0.3)
        assert _resident_fraction(t) == 0.0
    pop.thread.join(timeout=30)
    assert _resident_fraction(t) == 1.0  # it went on once the step was over


@linux_only
def test_background_populate_begins_after_the_first_step() -> None:
    t, pop = _pool((2, 2048, 16, 2, 8), block_dim=1, quiet_s=0.01)  # 4 MiB
    assert pop.thread is not None
    time.sleep(0.2)
    assert pop.thread.ident is None and _resident_fraction(t) == 0.0  # nothing during start-up
    with pop.paused():
        pass
    pop.thread.join(timeout=30)
    assert _resident_fraction(t) == 1.0


@linux_only
def test_background_populate_stops_when_asked_and_at_exit(monkeypatch: pytest.MonkeyPatch) -> None:
    # a thread held in a pause (as by a long step) ends at stop(), which the interpreter's exit calls: a daemon
    # thread left running into finalization aborted the process
    registered: list[object] = []
    monkeypatch.setattr(atexit, "register", lambda fn: registered.append(fn))
    monkeypatch.setattr(atexit, "unregister", lambda fn: registered.remove(fn))
    t, pop = _pool((4, 2048, 16, 2, 8), block_dim=1, quiet_s=0.05)  # 8 MiB
    assert pop.thread is not None
    with pop.paused():
        pop.start()
        assert registered == [pop.stop]
        time.sleep(0.2)
        assert pop.thread.is_alive()
        started = time.monotonic()
        pop.stop()
        assert not pop.thread.is_alive() and time.monotonic() - started < 1.0
    assert registered == []  # the thread took its hook off as it ended
    assert _resident_fraction(t) == 0.0  # stopped before any chunk


def _resident_fraction(t: torch.Tensor) -> float:
    """The share of t's pages in memory, by mincore(2)."""
    page = mmap.PAGESIZE
    start = t.data_ptr() - t.data_ptr() % page
    n = -(-(t.data_ptr() + t.numel() * t.element_size() - start) // page)
    vec = (ctypes.c_ubyte * n)()
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(n * page), vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec) / n
