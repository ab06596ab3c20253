"""Where oneDNN has no bf16 path (an AVX2-only CPU), UnquantizedLinearMethod packs float32 weights instead, and
the packed product equals F.linear's to float32 rounding. The CPU's answer is replaced here, so the case runs on
any CPU whose oneDNN packs float32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tokenmill.layers.linear as linear
from tokenmill.layers.linear import Linear, UnquantizedLinearMethod

pytestmark = pytest.mark.skipif(not linear.float32_packing_available(), reason="oneDNN does not pack float32 here")


def _loaded(method: UnquantizedLinearMethod, weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
    layer = Linear(weight.shape[1], weight.shape[0], bias is not None, weight.dtype, method)
    layer.weight_loader(layer.weight, weight)
    if bias is not None:
        layer.weight_loader(layer.bias, bias)
    method.process_weights_after_loading(layer)
    return layer


@pytest.mark.parametrize("bf16_packs", [False, True], ids=["no-bf16-path", "bf16-path"])
@pytest.mark.parametrize("rows", [1, 5, 17, 64])
def test_float32_is_packed_only_where_bf16_is_not(monkeypatch: pytest.MonkeyPatch, bf16_packs: bool,
                                                  rows: int) -> None:
    monkeypatch.setattr(linear, "packing_available", lambda: bf16_packs)
    method = UnquantizedLinearMethod()
    gen = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(96, 80, generator=gen), torch.randn(96, generator=gen)
    layer = _loaded(method, weight, bias)
    assert layer.packed == (not bf16_packs) and layer.weight.is_mkldnn == (not bf16_packs)
    x = torch.randn(rows, 80, generator=gen)
    torch.testing.assert_close(layer(x), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    assert not UnquantizedLinearMethod(pack=False).pack_float32


def test_a_bf16_weight_is_left_plain_where_only_float32_packs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(linear, "packing_available", lambda: False)
    method = UnquantizedLinearMethod()
    lin = nn.Linear(16, 16, bias=False).to(torch.bfloat16)
    layer = _loaded(method, lin.weight.detach(), None)
    assert not layer.packed and not layer.weight.is_mkldnn
