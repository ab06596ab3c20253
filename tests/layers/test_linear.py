"""The packed oneDNN linear (CPU bf16 fast path) against plain nn.Linear, its reference."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tokenmill.layers.linear import PackedLinear, pack_linears, packing_available

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
