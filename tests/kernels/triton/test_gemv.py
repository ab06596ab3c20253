"""The decode GEMV (kernels/triton/gemv.py) against F.linear, and its gated form against SiluAndMul then
F.linear: one row and several, N and K not multiples of the blocks, with and without a bias; and a model
layer that takes it. Under the interpreter on CPU (float32 to 1e-5; bf16 to 2e-2, the interpreter's bf16
casts truncating), on the GPU where one is present."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.kernels.triton.elementwise import TritonOps
from tokenmill.kernels.triton.gemv import (
    ENGINE_GEMV_ROWS,
    GEMV_DOT_MAX_ROWS,
    GEMV_MAX_ROWS,
    TritonGemv,
    gated_gemv,
    gemv,
    gemv_config,
    gemv_dot,
)
from tokenmill.layers.linear import Linear, UnquantizedLinearMethod

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    tol = 1e-5 if want.dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float().cpu(), want.float().cpu(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, GEMV_MAX_ROWS])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matches_linear(dtype: torch.dtype, rows: int, bias: bool) -> None:
    torch.manual_seed(rows)
    n, k = 37, 600  # neither a multiple of BLOCK_N nor of BLOCK_K
    w = (torch.randn(n, k, device=DEVICE) / k**0.5).to(dtype)
    b = torch.randn(n, device=DEVICE).to(dtype) if bias else None
    x = torch.randn(rows, k, device=DEVICE).to(dtype)
    got = gemv(x, w, b)
    assert got.shape == (rows, n) and got.dtype == dtype
    close(got, F.linear(x.float(), w.float(), None if b is None else b.float()).to(dtype))


@pytest.mark.parametrize("config", [(4, 128, 4), (8, 64, 2), (16, 256, 4), (2, 128, 4)])
@pytest.mark.parametrize("rows", [1, 2])
def test_gemv_configs(config: tuple[int, int, int], rows: int) -> None:
    torch.manual_seed(4)
    w = torch.randn(70, 300, device=DEVICE)
    x = torch.randn(rows, 300, device=DEVICE)
    close(gemv(x, w, config=config), x @ w.T)


@pytest.mark.parametrize("gated", [False, True])
def test_gemv_over_several_slices_at_its_default_tiles(gated: bool) -> None:
    """One row at the engine's tiles (BLOCK_K 1,024) over a K of three slices, the last one partial."""
    torch.manual_seed(8)
    n, k = 9, 2600
    w = torch.randn(n, k, device=DEVICE) / k**0.5
    x = torch.randn(1, 2 * k if gated else k, device=DEVICE)
    act = TritonOps.silu_and_mul(x) if gated else x
    assert gemv_config(1, n, k)[1] < k
    close(gemv(x, w, gated=gated), F.linear(act, w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5])
def test_gated_gemv_matches_silu_and_mul_then_linear(dtype: torch.dtype, rows: int) -> None:
    torch.manual_seed(5)
    inter, hidden = 200, 48
    gate_up = (torch.randn(rows, 2 * inter, device=DEVICE) * 2).to(dtype)
    w = (torch.randn(hidden, inter, device=DEVICE) / inter**0.5).to(dtype)
    act = TritonOps.silu_and_mul(gate_up)  # the fused op whose rounding the gated GEMV repeats
    close(gated_gemv(gate_up, w, None), F.linear(act.float(), w.float()).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, GEMV_DOT_MAX_ROWS])
@pytest.mark.parametrize("gated", [False, True])
def test_gemv_dot_matches_linear(dtype: torch.dtype, rows: int, gated: bool) -> None:
    torch.manual_seed(7 + rows)
    n, k = 45, 300  # neither a multiple of BLOCK_N (16) nor of BLOCK_K (128)
    w = (torch.randn(n, k, device=DEVICE) / k**0.5).to(dtype)
    b = torch.randn(n, device=DEVICE).to(dtype)
    x = (torch.randn(rows, 2 * k if gated else k, device=DEVICE) * 2).to(dtype)
    act = TritonOps.silu_and_mul(x) if gated else x
    got = gemv_dot(x, w, b, gated=gated, config=(16, 128, 4))
    assert got.shape == (rows, n) and got.dtype == dtype
    close(got, F.linear(act.float(), w.float(), b.float()).to(dtype))
    with pytest.raises(ValueError, match="rows"):
        gemv_dot(torch.randn(GEMV_DOT_MAX_ROWS + 1, k, device=DEVICE), w.float())


def test_gemv_refuses_what_it_does_not_take() -> None:
    w = torch.randn(8, 16, device=DEVICE)
    with pytest.raises(ValueError, match="width"):
        gemv(torch.randn(1, 15, device=DEVICE), w)
    with pytest.raises(ValueError, match="rows"):
        gemv(torch.randn(GEMV_MAX_ROWS + 1, 16, device=DEVICE), w)
    assert gemv(torch.randn(0, 16, device=DEVICE), w).shape == (0, 8)


def test_linear_layer_takes_the_gemv_up_to_its_rows() -> None:
    """A layer given the GEMV runs it for inputs of up to its row limit (ENGINE_GEMV_ROWS: decode at batch 1)
    and F.linear past it, with the same products either way; its gated form is None past the limit (the MLP
    then runs them apart)."""
    torch.manual_seed(6)
    layer = Linear(64, 24, True, torch.float32, UnquantizedLinearMethod(pack=False)).to(DEVICE)
    with torch.no_grad():
        layer.weight.normal_()
        assert layer.bias is not None
        layer.bias.normal_()
    calls: list[int] = []

    class Counting(TritonGemv):
        gated_gemv = staticmethod(gated_gemv)  # (not offered by default: see the last lines)

        @staticmethod
        def packed_gemv(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            calls.append(rows.shape[0])
            return gemv(rows, weight, bias)

    UnquantizedLinearMethod.enable_gemv(layer, Counting())
    assert layer.gemv_max_rows == ENGINE_GEMV_ROWS
    for shape in [(1, 64), (1, ENGINE_GEMV_ROWS, 64), (ENGINE_GEMV_ROWS + 1, 64)]:
        x = torch.randn(*shape, device=DEVICE)
        close(layer(x), F.linear(x, layer.weight, layer.bias))
    assert calls == [1, ENGINE_GEMV_ROWS]
    assert layer.gated_forward(torch.randn(ENGINE_GEMV_ROWS + 1, 128, device=DEVICE)) is None
    gate_up = torch.randn(1, 128, device=DEVICE)
    fused = layer.gated_forward(gate_up)
    assert fused is not None
    close(fused, F.linear(TritonOps.silu_and_mul(gate_up), layer.weight, layer.bias))
    # the engine's TritonGemv offers no gated form: the MLP runs SiLU-and-mul, then the plain GEMV
    UnquantizedLinearMethod.enable_gemv(layer, TritonGemv())
    assert layer.gated_forward(gate_up) is None
