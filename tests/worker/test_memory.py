"""The CPU worker's host memory helpers."""

from __future__ import annotations

import sys

import torch

from tokenmill.worker.memory import keep_freed_memory, zeros_lazily


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
