"""The C++ argmax of greedy sampling (kernels/cpu/sampling/argmax_rows.cpp), bf16 and float32, against torch's
argmax: the first index of the maximum, -0 == +0, NaN skipped, on vocabularies on and off its 512-wide blocks."""

from __future__ import annotations

import pytest
import torch

from tokenmill.kernels import load_cpu_kernels

OPS = load_cpu_kernels()
pytestmark = pytest.mark.skipif(OPS is None, reason="C++ kernels unavailable")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("v", [1, 31, 511, 512, 513, 1025, 32000])
def test_argmax_rows(v: int, dtype: torch.dtype) -> None:
    # ties to the first index, -0 == +0, NaN skipped (a row all NaN: the last index), as before
    torch.manual_seed(v)
    x = torch.randint(-4, 3, (7, v)).to(dtype)
    x[1] = x[1].clamp(max=0) * 0.0  # -0 and +0 mixed
    x[2, ::3] = float("nan")
    x[3] = float("nan")
    x[4] = float("-inf")
    x[5] = torch.randn(v).to(dtype)
    x[6] = torch.randn(v).to(dtype) * 1e-30  # float32's small magnitudes (denormals in bf16's range too)
    expected = torch.where(x.isnan(), float("-inf"), x.float()).argmax(dim=-1)
    expected[3] = v - 1
    assert OPS.argmax_rows(x).tolist() == expected.tolist()


def test_argmax_rows_checks_its_input() -> None:
    with pytest.raises(RuntimeError, match="needs bfloat16 or float32"):
        OPS.argmax_rows(torch.zeros(2, 8, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="contiguous 2-D"):
        OPS.argmax_rows(torch.zeros(8, 2, dtype=torch.bfloat16).t())
    with pytest.raises(RuntimeError, match="empty rows"):
        OPS.argmax_rows(torch.zeros(2, 0, dtype=torch.bfloat16))
