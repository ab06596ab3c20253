"""The packed oneDNN linear (CPU bf16 fast path) and the C++ GEMV it uses where that is faster (1-4
rows; any number of rows for K up to 2048, in tiles), against plain nn.Linear, their reference."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.kernels import load_cpu_kernels
from tokenmill.layers.linear import PackedLinear, gemv_layout_ok, pack_linears, packing_available

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

    def packed_gemv_max_rows(self, in_features: int) -> int:
        return int(self.ops.packed_gemv_max_rows(in_features))


def _gemv_vs_reference(out_features: int, in_features: int, shape: tuple[int, ...], bias: bool) -> int:
    """Runs a GEMV-enabled PackedLinear against nn.Linear in float; returns how often it took the GEMV."""
    torch.manual_seed(out_features + in_features)
    lin = nn.Linear(in_features, out_features, bias=bias).to(torch.bfloat16)
    x = torch.randn(*shape, in_features, dtype=torch.bfloat16)
    expected = F.linear(x.float(), lin.weight.float(), None if lin.bias is None else lin.bias.float())
    packed = PackedLinear(lin)
    ops = CountingOps(OPS)
    packed.enable_gemv(ops)
    got = packed(x)
    assert got.dtype == torch.bfloat16 and got.shape == expected.shape
    # fp32 accumulation, one bf16 rounding: within a bf16 ulp of the exact product
    torch.testing.assert_close(got.float(), expected, rtol=2**-7, atol=1e-4)
    return ops.calls


@needs_gemv
@pytest.mark.parametrize("out_features,in_features", [(70, 33), (200, 96), (64, 32), (5, 1)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 12, 13, 64, 301])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_equals_reference(out_features: int, in_features: int, rows: int, bias: bool) -> None:
    """1-4 rows take the GEMV's row loop, more take its tiles of 6 (full tiles and every tail size)."""
    assert _gemv_vs_reference(out_features, in_features, (rows,), bias) == 1


@needs_gemv
@pytest.mark.parametrize("rows,gemv", [(1, True), (4, True), (5, False), (64, False)])
def test_gemv_leaves_large_k_beyond_four_rows_to_onednn(rows: int, gemv: bool) -> None:
    """K past 2048 (padded): the weight block no longer fits L2 beside the next one, so oneDNN takes
    more than 4 rows."""
    assert OPS.packed_gemv_max_rows(2080) == 4 and OPS.packed_gemv_max_rows(2048) > 2**40
    assert _gemv_vs_reference(70, 2080, (rows,), bias=True) == int(gemv)


@needs_gemv
@pytest.mark.parametrize("out_features", [1280, 32000])
@pytest.mark.parametrize("rows", [1, 37])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_model_shapes(out_features: int, rows: int, bias: bool) -> None:
    assert _gemv_vs_reference(out_features, 768, (rows,), bias) == 1


@needs_gemv
@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("rows", [3, 50])
def test_gemv_threads_split_the_blocks(threads: int, rows: int) -> None:
    """Threads take ranges of 64-output blocks, and with fewer than 4 blocks per thread (6 here) ranges
    of rows within them as well: the same numbers as one thread, bitwise."""
    torch.manual_seed(rows)
    lin = nn.Linear(160, 330).to(torch.bfloat16)
    x = torch.randn(rows, 160, dtype=torch.bfloat16)
    packed = PackedLinear(lin)
    packed.enable_gemv(OPS)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = packed(x)
        torch.set_num_threads(threads)
        many = packed(x)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(many, one, rtol=0, atol=0)
    expected = F.linear(x.float(), lin.weight.float(), lin.bias.float())
    torch.testing.assert_close(one.float(), expected, rtol=2**-7, atol=1e-4)


@needs_gemv
def test_gemv_takes_no_rows() -> None:
    packed = PackedLinear(nn.Linear(96, 200).to(torch.bfloat16))
    packed.enable_gemv(OPS)
    assert packed(torch.empty(0, 96, dtype=torch.bfloat16)).shape == (0, 200)


@needs_gemv
@pytest.mark.parametrize("shape", [(1, 1), (2, 2), (4, 1), (2, 3), (5, 7)])
def test_gemv_leading_dims(shape: tuple[int, ...]) -> None:
    assert _gemv_vs_reference(200, 96, shape, bias=True) == 1


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
