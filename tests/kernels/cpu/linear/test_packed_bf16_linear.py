"""The packed bf16 linear (oneDNN, and tokenmill's GEMV where it reads oneDNN's layout for that shape)
against F.linear, for shapes whose packed layout differs between CPUs (an AMX Xeon packs N = 64 in a
layout of the same size that the GEMV does not read), and the row counts oneDNN is called with."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.kernels import load_cpu_kernels
from tokenmill.layers.linear import Linear, UnquantizedLinearMethod, onednn_rows, packing_available

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
    for rows in (1, 3, 4, 13, 17, 40, 100, 129):  # 17 and up: run padded to onednn_rows
        x = torch.randn(rows, in_features, generator=gen).to(torch.bfloat16)
        expected = F.linear(x.float(), weight.float(), bias.float())
        got = layer(x).float()
        scale = float(expected.abs().max())
        assert (got - expected).abs().max() <= 2**-6 * scale + 1e-2, (rows, layer.gemv_ops is not None)


def test_onednn_rows_bounds_the_row_counts_and_the_padding() -> None:
    counts = [onednn_rows(m) for m in range(1, 4097)]
    assert counts[:16] == list(range(1, 17))
    for m, padded in enumerate(counts, 1):
        assert m <= padded <= m * 9 / 8, m
        assert onednn_rows(padded) == padded  # a padded count is its own
    assert len(set(counts)) <= 16 + 8 * 8  # exact up to 16, then 8 per power of two
    assert counts == [OPS.onednn_rows(m) for m in range(1, 4097)]  # the fused decode step's C++ copy


def test_packed_layer_calls_onednn_with_padded_row_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []
    onednn = torch.ops.mkldnn._linear_pointwise

    def spy(x: torch.Tensor, *args: object) -> torch.Tensor:
        seen.append(x.shape[0])
        return onednn(x, *args)

    method = UnquantizedLinearMethod(OPS)
    layer = Linear(64, 96, False, torch.bfloat16, method)
    layer.weight.data.copy_(torch.randn(96, 64).to(torch.bfloat16))
    method.process_weights_after_loading(layer)
    # without AMX the tiled GEMV takes every row count of a short K (gemv.cpp, packed_gemv_max_rows); these rows
    # are oneDNN's here
    layer.gemv_ops = None
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", spy)
    for rows in (17, 18, 33, 100, 300):
        assert layer(torch.randn(2, rows, 64).to(torch.bfloat16)).shape == (2, rows, 96)
    assert seen == [onednn_rows(2 * rows) for rows in (17, 18, 33, 100, 300)] == [36, 36, 72, 208, 640]
