"""The rounding ops (rtn_int8, rtn_int4 in kernels/cpu/linear/quantized.cpp) against the torch reference they stand
in for at load (reference.rtn_int8 then weight_sum, reference.rtn_int4 then pack_int4): the same integers, scales
and zero points, bit for bit, for bf16, fp16 and fp32 weights, every group size (K on and off the group and off
32), symmetric and asymmetric."""

from __future__ import annotations

import pytest
import torch

from tokenmill.kernels import load_cpu_kernels
from tokenmill.layers.quantization import reference as ref

OPS = load_cpu_kernels()
pytestmark = pytest.mark.skipif(OPS is None, reason="tokenmill's CPU kernels are not built here")

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _weight(n: int, k: int, dtype: torch.dtype, seed: int, offset: float = 0.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05 + offset
    w[0, : min(k, 5)] = 0.0  # a run of zeros, and (n > 1) a row of them: the 1e-10 floor of the scale
    if n > 1:
        w[-1] = 0.0
    return w.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", [(1, 1), (7, 70), (33, 256), (5, 2048)])
def test_rtn_int8_is_the_reference(n: int, k: int, dtype: torch.dtype) -> None:
    w = _weight(n, k, dtype, n * 1000 + k)
    q, scale, wsum = OPS.rtn_int8(w)
    q_ref, scale_ref = ref.rtn_int8(w)
    assert torch.equal(q, q_ref) and torch.equal(scale, scale_ref)
    assert torch.equal(wsum, ref.weight_sum(q_ref))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("zero_point", [False, True])
@pytest.mark.parametrize("n,k,group", [(7, 100, 32), (33, 256, 128), (3, 2048, 128), (5, 70, 70), (16, 130, 64),
                                       (4, 64, 64), (2, 1000, 256), (1, 31, 31)])
def test_rtn_int4_is_the_reference_packed(n: int, k: int, group: int, zero_point: bool, dtype: torch.dtype) -> None:
    w = _weight(n, k, dtype, n * 1000 + k + group, 0.02 if zero_point else 0.0)
    packed, scale, zero = OPS.rtn_int4(w, group, zero_point)
    q_ref, scale_ref, zero_ref = ref.rtn_int4(w, group, zero_point)
    assert torch.equal(scale, scale_ref) and torch.equal(zero, zero_ref)
    assert torch.equal(packed, ref.pack_int4(q_ref))


def test_rtn_int4_refuses_a_group_the_packed_layout_cannot_hold() -> None:
    with pytest.raises(RuntimeError, match="multiple of 32"):
        OPS.rtn_int4(torch.zeros(2, 64), 16, False)
