"""The roofline's C++ loops (kernels/cpu/roofline/peak.cpp): each runs and reports a rate, or 0 where
this CPU or compiler lacks its instructions; bad arguments are errors, not crashes."""

from __future__ import annotations

import pytest
import torch

from tokenmill.bench.roofline import isa_flags
from tokenmill.kernels import load_cpu_kernels

ops = load_cpu_kernels()
pytestmark = pytest.mark.skipif(ops is None, reason="the C++ CPU kernels could not be built here")


@pytest.mark.parametrize("kind, flag", [("avx512_fp32", "avx512f"), ("avx2_fp32", "avx2"),
                                        ("avx512_bf16", "avx512_bf16"), ("amx_bf16", "amx_bf16")])
def test_peak_loops_run_where_the_cpu_has_them(kind: str, flag: str) -> None:
    rate = ops.roofline_peak(kind, 2000, 1)
    if flag in isa_flags():
        assert rate > 0
    else:
        assert rate == 0.0


def test_peak_refuses_unknown_kinds_and_bad_counts() -> None:
    with pytest.raises(RuntimeError, match="unknown kind"):
        ops.roofline_peak("sse", 10, 1)
    with pytest.raises(RuntimeError, match="positive"):
        ops.roofline_peak("avx512_fp32", 0, 1)


def test_stream_read_reads_and_checks_its_buffer() -> None:
    a = torch.ones(1 << 20, dtype=torch.float32)  # 4 MiB
    assert ops.roofline_stream_read(a, 1) > 0 and ops.roofline_stream_read(a, 2) > 0
    with pytest.raises(RuntimeError, match="too small"):
        ops.roofline_stream_read(torch.ones(8), 1)
    with pytest.raises(RuntimeError, match="contiguous"):
        ops.roofline_stream_read(torch.ones(64, 64).t(), 1)
