"""The packed bf16 linear (oneDNN, and tokenmill's GEMV where it reads oneDNN's layout for that shape)
against F.linear, for shapes whose packed layout differs between CPUs (an AMX Xeon packs N = 64 in a
layout of the same size that the GEMV does not read)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.kernels import load_cpu_kernels
from tokenmill.layers.linear import Linear, UnquantizedLinearMethod, packing_available

OPS = load_cpu_kernels()
pytestmark = pytest.mark.skipif(OPS is None or not packing_available(), reason="C++ kernels or oneDNN unavailable")


@pytest.mark.parametrize("out_features, in_features", [(64, 64), (64, 128), (128, 64), (70, 33), (512, 64),
                                                       (32, 64), (96, 160)])
def test_packed_layer_equals_f_linear(out_features: int, in_features: int) -> None:
    gen = torch.Generator().manual_seed(out_features * 1000 + in_features)
    weight = torch.randn(out_features, in_features, generator=gen).to(torch.bfloat16)
    bias = torch.randn(out_features, generator=gen).to(torch.bfloat16)
    method = UnquantizedLinearMethod(OPS)
    layer = Linear(in_features, out_features, True, torch.bfloat16, method)
    layer.weight.data.copy_(weight)
    assert layer.bias is not None
    layer.bias.data.copy_(bias)
    method.process_weights_after_loading(layer)
    assert layer.packed
    for rows in (1, 3, 4, 13, 40):
        x = torch.randn(rows, in_features, generator=gen).to(torch.bfloat16)
        expected = F.linear(x.float(), weight.float(), bias.float())
        got = layer(x).float()
        scale = float(expected.abs().max())
        assert (got - expected).abs().max() <= 2**-6 * scale + 1e-2, (rows, layer.gemv_ops is not None)
