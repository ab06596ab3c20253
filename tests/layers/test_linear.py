"""The packed oneDNN linear (CPU bf16 fast path) and the C++ GEMV it uses for 1-4 rows, against
plain nn.Linear, their reference."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.attention.cpu_kernels import load_cpu_kernels
from tokenmill.layers.linear import GEMV_MAX_ROWS, PackedLinear, gemv_layout_ok, pack_linears, packing_available

pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch has no oneDNN")


@pytest.mark.parametrize("batch", [1, 3, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_equals_plain(batch: int, bias: bool) -> None:
    torch.manual_seed(batch)
    lin = nn.Linear(96, 200, bias=bias).to(torch.bfloat16)
    x = torch.randn(batch, 96, dtype=torch.bfloat16)
    expected = lin(x)
    got = PackedLinear(lin)(x)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_pack_linears_swaps_only_bf16_cpu() -> None:
    model = nn.Sequential(nn.Linear(8, 8).to(torch.bfloat16), nn.Linear(8, 8))
    assert pack_linears(model) == 1
    assert isinstance(model[0], PackedLinear) and isinstance(model[1], nn.Linear)


OPS = load_cpu_kernels()
HAS_GEMV = OPS is not None and bool(OPS.has_packed_gemv())
# oneDNN packs another layout on some CPUs (an AMX Xeon pads N to 32): the GEMV is off there
needs_gemv = pytest.mark.skipif(not (HAS_GEMV and gemv_layout_ok(OPS)),
                                reason="no AVX512-BF16 packed GEMV, or oneDNN packs another layout here")


class CountingOps:
    """The C++ ops, counting packed_gemv calls: which path a layer took."""

    def __init__(self, ops: Any) -> None:
        self.ops, self.calls = ops, 0

    def has_packed_gemv(self) -> bool:
        return bool(self.ops.has_packed_gemv())

    def packed_gemv(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        self.calls += 1
        return self.ops.packed_gemv(x, weight, bias)


def _gemv_vs_reference(out_features: int, in_features: int, shape: tuple[int, ...], bias: bool) -> int:
    """Runs a GEMV-enabled PackedLinear against nn.Linear in float; returns how often it took the GEMV."""
    torch.manual_seed(out_features + in_features)
    lin = nn.Linear(in_features, out_features, bias=bias).to(torch.bfloat16)
    x = torch.randn(*shape, in_features, dtype=torch.bfloat16)
    expected = F.linear(x.float(), lin.weight.float(), None if lin.bias is None else lin.bias.float())
    packed = PackedLinear(lin)
    packed.gemv_ops = ops = CountingOps(OPS)
    got = packed(x)
    assert got.dtype == torch.bfloat16 and got.shape == expected.shape
    # fp32 accumulation, one bf16 rounding: within a bf16 ulp of the exact product
    torch.testing.assert_close(got.float(), expected, rtol=2**-7, atol=1e-4)
    return ops.calls


@needs_gemv
@pytest.mark.parametrize("out_features,in_features", [(70, 33), (200, 96), (64, 32), (5, 1)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_equals_reference(out_features: int, in_features: int, rows: int, bias: bool) -> None:
    calls = _gemv_vs_reference(out_features, in_features, (rows,), bias)
    assert calls == (1 if rows <= GEMV_MAX_ROWS else 0)  # 5 rows: oneDNN


@needs_gemv
@pytest.mark.parametrize("out_features", [1280, 32000])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_model_shapes(out_features: int, bias: bool) -> None:
    assert _gemv_vs_reference(out_features, 768, (1,), bias) == 1


@needs_gemv
@pytest.mark.parametrize("shape,gemv", [((1, 1), True), ((2, 2), True), ((4, 1), True), ((2, 3), False)])
def test_gemv_leading_dims(shape: tuple[int, ...], gemv: bool) -> None:
    assert _gemv_vs_reference(200, 96, shape, bias=True) == int(gemv)


@pytest.mark.skipif(not HAS_GEMV, reason="no AVX512-BF16 packed GEMV")
def test_gemv_layout_probe_follows_the_packed_layout() -> None:
    """On: where oneDNN packs AB16b64a2b (this project's CI machine, Zen 5); off, without ever
    calling the GEMV on a buffer of another size, where it packs otherwise."""
    lin = nn.Linear(33, 70).to(torch.bfloat16)
    packed = PackedLinear(lin)
    ab16b64a2b = int(torch.ops.mkldnn._nbytes(packed.weight)) == 128 * 64 * 2
    assert gemv_layout_ok(OPS) == ab16b64a2b


@needs_gemv
def test_pack_linears_enables_gemv_only_with_ops() -> None:
    def model() -> nn.Module:
        return nn.Sequential(nn.Linear(96, 200).to(torch.bfloat16), nn.Linear(200, 96).to(torch.bfloat16))

    plain, fast = model(), model()
    pack_linears(plain)
    pack_linears(fast, OPS)
    assert all(isinstance(m, PackedLinear) and m.gemv_ops is None for m in plain)
    assert all(isinstance(m, PackedLinear) and m.gemv_ops is OPS for m in fast)


class WrongLayoutOps:
    """A GEMV that reads the packed weight wrongly: the probe must catch it."""

    def has_packed_gemv(self) -> bool:
        return True

    def packed_gemv(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.zeros(x.shape[0], weight.shape[0], dtype=x.dtype)


def test_pack_linears_keeps_onednn_when_the_probe_fails() -> None:
    model = nn.Sequential(nn.Linear(96, 200).to(torch.bfloat16))
    assert not gemv_layout_ok(WrongLayoutOps())
    pack_linears(model, WrongLayoutOps())
    assert isinstance(model[0], PackedLinear) and model[0].gemv_ops is None
