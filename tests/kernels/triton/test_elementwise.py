"""The fused Triton elementwise ops against the layers' torch paths (the ops the C++ kernels are tested
against too): RMSNorm with and without the residual, rotary over strided q/k, SiLU-and-mul. Under the
interpreter bf16 casts truncate rather than round, so bf16 is compared to within one bf16 step."""

from __future__ import annotations

import pytest
import torch

from tokenmill.arch import RopeConfig
from tokenmill.kernels.triton.elementwise import TritonOps
from tokenmill.layers.activation import SiluAndMul
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import RotaryEmbedding

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.bfloat16]


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    tol = 1e-6 if want.dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(got.float().cpu(), want.float().cpu(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_with_and_without_residual(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    norm = RMSNorm(96, 1e-6).to(DEVICE)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.2)
    norm = norm.to(dtype)
    x = torch.randn(5, 96, device=DEVICE).to(dtype)
    res = torch.randn(5, 96, device=DEVICE).to(dtype)
    close(TritonOps.rms_norm(x, norm.weight, 1e-6, None), norm(x))
    want, want_res = norm(x, res.clone())
    got_res = res.clone()
    close(TritonOps.rms_norm(x, norm.weight, 1e-6, got_res), want)
    close(got_res, want_res)  # the sum, in place


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("one_launch", [False, True], ids=["rotary_", "rotary_qk_"])
def test_rotary_in_place_on_strided_rows(dtype: torch.dtype, one_launch: bool) -> None:
    torch.manual_seed(1)
    with torch.device(DEVICE):
        rope = RotaryEmbedding(32, 64, RopeConfig(theta=10000.0), dtype)
    qkv = torch.randn(6, 6 + 2 * 2, 32, device=DEVICE).to(dtype)  # q (6 heads), k, v (2 each) of one tensor
    q, k = qkv[:, :6], qkv[:, 6:8]
    positions = torch.tensor([0, 3, 17, 5, 63, 40], device=DEVICE)
    want_q, want_k = rope(positions, q.clone(), k.clone())
    v_before = qkv[:, 8:].clone()
    if one_launch:
        TritonOps.rotary_qk_(q, k, positions, rope.cos_cache, rope.sin_cache)
    else:
        TritonOps.rotary_(q, positions, rope.cos_cache, rope.sin_cache)
        TritonOps.rotary_(k, positions, rope.cos_cache, rope.sin_cache)
    close(q, want_q)
    close(k, want_k)
    assert torch.equal(qkv[:, 8:], v_before)  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype: torch.dtype) -> None:
    torch.manual_seed(2)
    x = (torch.randn(4, 2 * 200, device=DEVICE) * 3).to(dtype)
    close(TritonOps.silu_and_mul(x), SiluAndMul()(x))
