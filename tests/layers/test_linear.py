"""The unquantized linear method's packed oneDNN path (CPU bf16) and the C++ GEMV it uses where that is
faster (1-4 rows; any number of rows for K up to 2048, in tiles; 1-32 rows in AMX tiles where AMX-BF16 is
usable), against plain nn.Linear, their reference; tokenmill's packer into oneDNN's layout, against oneDNN's reorder;
and the layers' shard loading."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.kernels import load_cpu_kernels
from tokenmill.layers.linear import (
    Linear,
    MergedLinear,
    QKVLinear,
    UnquantizedLinearMethod,
    WeightPacker,
    WeightStaging,
    gemv_layout_ok,
    linear_gelu,
    pack_weight,
    packed_linear,
    packing_available,
)

pytestmark = pytest.mark.skipif(not packing_available(), reason="oneDNN cannot pack bf16 weights here")


@pytest.mark.parametrize("batch", [1, 3, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_equals_plain(batch: int, bias: bool) -> None:
    torch.manual_seed(batch)
    lin = nn.Linear(96, 200, bias=bias).to(torch.bfloat16)
    x = torch.randn(batch, 96, dtype=torch.bfloat16)
    expected = lin(x)
    got = packed_linear(lin.weight, lin.bias)(x)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def _loaded(layer: Linear, method: UnquantizedLinearMethod, lin: nn.Linear) -> Linear:
    layer.weight_loader(layer.weight, lin.weight.detach())
    method.process_weights_after_loading(layer)
    return layer


def test_method_packs_only_bf16_cpu() -> None:
    method = UnquantizedLinearMethod()
    bf16, fp32 = nn.Linear(8, 8, bias=False).to(torch.bfloat16), nn.Linear(8, 8, bias=False)
    packed = _loaded(Linear(8, 8, False, torch.bfloat16, method), method, bf16)
    plain = _loaded(Linear(8, 8, False, torch.float32, method), method, fp32)
    assert packed.packed and packed.weight.is_mkldnn and not plain.packed
    x = torch.randn(3, 8)
    torch.testing.assert_close(plain(x), fp32(x), rtol=0, atol=0)
    torch.testing.assert_close(packed(x.to(torch.bfloat16)), bf16(x.to(torch.bfloat16)), rtol=0, atol=0)


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_bf16_products_round_rows_and_add_a_float32_bias(rows: int) -> None:
    torch.manual_seed(rows)
    ref = nn.Linear(96, 200)
    method = UnquantizedLinearMethod(weight_dtype=torch.bfloat16, bf16_products=True)
    layer = Linear(96, 200, True, torch.float32, method)
    layer.weight_loader(layer.weight, ref.weight.detach())
    layer.weight_loader(layer.bias, ref.bias.detach())
    method.process_weights_after_loading(layer)
    assert layer.packed and layer.weight.dtype == torch.bfloat16 and layer.bias is not None
    assert layer.bias.dtype == torch.float32
    x = torch.randn(rows, 96)
    want = F.linear(x.to(torch.bfloat16), ref.weight.detach().to(torch.bfloat16)).float() + ref.bias.detach()
    for rows_in in (x, x.to(torch.bfloat16)):  # float32 rows are rounded to bf16 first; bf16 ones go as they are
        got = layer(rows_in)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("rows", [3, 37])
def test_linear_gelu_fused_into_onednn_rounds_once(approximate: str, rows: int) -> None:
    torch.manual_seed(rows)
    lin = nn.Linear(96, 200).to(torch.bfloat16)
    method = UnquantizedLinearMethod()
    layer = Linear(96, 200, True, torch.bfloat16, method)
    layer.weight_loader(layer.weight, lin.weight.detach())
    assert layer.bias is not None
    layer.weight_loader(layer.bias, lin.bias.detach())
    method.process_weights_after_loading(layer)
    assert layer.packed
    x = torch.randn(rows, 96, dtype=torch.bfloat16)
    # the float32 result of the same bf16 values, through the GELU, then rounded once to bf16
    exact = F.gelu(F.linear(x.float(), lin.weight.detach().float(), lin.bias.detach().float()), approximate=approximate)
    got = linear_gelu(layer, x, approximate)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), exact, rtol=2 ** -8, atol=1e-5)


def test_fused_layers_load_their_shards_and_report_the_missing() -> None:
    method = UnquantizedLinearMethod(pack=False)
    qkv = QKVLinear(16, 4, 2, 1, True, torch.float32, method)
    parts = {s: torch.randn(n, 16) for s, n in (("q", 8), ("k", 4), ("v", 4))}
    for s in ("q", "v"):
        qkv.weight_loader(qkv.weight, parts[s], s)
    assert qkv.missing_weights() == ["weight[k]", "bias[q]", "bias[k]", "bias[v]"]
    qkv.weight_loader(qkv.weight, parts["k"], "k")
    torch.testing.assert_close(qkv.weight.data, torch.cat([parts["q"], parts["k"], parts["v"]]))
    with pytest.raises(ValueError, match="does not match"):
        qkv.weight_loader(qkv.weight, torch.randn(5, 16), "q")
    gate_up = MergedLinear(16, [6, 6], False, torch.float32, method)
    gate_up.weight_loader(gate_up.weight, torch.ones(6, 16), 1)
    assert gate_up.missing_weights() == ["weight[0]"] and bool((gate_up.weight.data[6:] == 1).all())


def _pack_reference(weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    return packed_linear(weight, bias)(x)


def test_staged_fused_layers_are_packed_as_they_complete_and_share_one_buffer() -> None:
    """Under a model loader (`staging` set), a repacking layer's shards go into a buffer of the staging pool, the
    layer is packed when its last tensor arrives, and the buffer serves the next layer of that shape."""
    torch.manual_seed(0)
    method, staging = UnquantizedLinearMethod(), WeightStaging()
    layers = [MergedLinear(64, [96, 96], False, torch.bfloat16, method) for _ in range(2)]
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    addresses = []
    for layer in layers:
        layer.staging = staging
        gate, up = (torch.randn(96, 64, dtype=torch.bfloat16) for _ in range(2))
        layer.weight_loader(layer.weight, up, 1)
        assert not layer.processed and layer._staged is not None
        addresses.append(layer._staged.data_ptr())
        layer.weight_loader(layer.weight, gate, 0)
        assert layer.processed and layer.packed and layer._staged is None
        torch.testing.assert_close(layer(x), _pack_reference(torch.cat([gate, up]), None, x), rtol=0, atol=0)
    assert addresses[0] == addresses[1]  # the first layer's buffer, given back once it was packed


def test_a_staged_whole_weight_is_packed_from_the_tensor_it_is_handed() -> None:
    """A one-shard layer with nothing else to load packs the checkpoint's tensor itself (no copy, no buffer); one
    with a bias still to come is staged, and packed when the bias arrives; a float32 checkpoint tensor under a
    bf16 layer is cast into a staged buffer."""
    torch.manual_seed(1)
    method, staging = UnquantizedLinearMethod(), WeightStaging()
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    weight, bias = torch.randn(80, 64, dtype=torch.bfloat16), torch.randn(80, dtype=torch.bfloat16)
    plain = Linear(64, 80, False, torch.bfloat16, method)
    plain.staging = staging
    plain.weight_loader(plain.weight, weight)
    assert plain.processed and plain.packed and not staging._free
    torch.testing.assert_close(plain(x), _pack_reference(weight, None, x), rtol=0, atol=0)
    biased = Linear(64, 80, True, torch.bfloat16, method)
    biased.staging = staging
    biased.weight_loader(biased.weight, weight.float())
    assert not biased.processed and biased._staged is not None
    assert biased.bias is not None
    biased.weight_loader(biased.bias, bias)
    assert biased.processed and len(staging._free[((80, 64), torch.bfloat16, torch.device("cpu"))]) == 1
    torch.testing.assert_close(biased(x), _pack_reference(weight, bias, x), rtol=0, atol=0)


def test_a_method_that_does_not_repack_is_loaded_and_processed_as_before() -> None:
    method, staging = UnquantizedLinearMethod(pack=False), WeightStaging()
    layer = Linear(16, 8, False, torch.bfloat16, method)
    layer.staging = staging
    weight = torch.randn(8, 16, dtype=torch.bfloat16)
    layer.weight_loader(layer.weight, weight)
    assert not layer.processed and layer._staged is None and layer.weight.data_ptr() != weight.data_ptr()
    torch.testing.assert_close(layer.weight.data, weight, rtol=0, atol=0)


OPS = load_cpu_kernels()
HAS_GEMV = OPS is not None and bool(OPS.has_packed_gemv())
# oneDNN packs another layout on some CPUs (an AMX Xeon pads N to 32): the GEMV is off there
needs_gemv = pytest.mark.skipif(not (HAS_GEMV and gemv_layout_ok(OPS)),
                                reason="no AVX512-BF16 packed GEMV, or oneDNN packs another layout here")


class CountingOps:
    """The C++ ops, counting packed_gemv calls: which path a layer took."""

    def __init__(self, ops: Any, max_rows: int | None = None) -> None:
        self.ops, self.calls = ops, 0
        self.max_rows = max_rows  # in place of the kernel's own packed_gemv_max_rows (to test its row paths)

    def has_packed_gemv(self) -> bool:
        return bool(self.ops.has_packed_gemv())

    def packed_gemv(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        self.calls += 1
        return self.ops.packed_gemv(x, weight, bias)

    def packed_gemv_max_rows(self, in_features: int) -> int:
        return int(self.ops.packed_gemv_max_rows(in_features)) if self.max_rows is None else self.max_rows


def _gemv_vs_reference(out_features: int, in_features: int, shape: tuple[int, ...], bias: bool,
                       max_rows: int | None = None) -> int:
    """Runs a GEMV-enabled packed layer against nn.Linear in float; returns how often it took the GEMV
    (max_rows: the rows it takes, in place of the kernel's own choice)."""
    torch.manual_seed(out_features + in_features)
    lin = nn.Linear(in_features, out_features, bias=bias).to(torch.bfloat16)
    x = torch.randn(*shape, in_features, dtype=torch.bfloat16)
    expected = F.linear(x.float(), lin.weight.float(), None if lin.bias is None else lin.bias.float())
    ops = CountingOps(OPS, max_rows)
    packed = packed_linear(lin.weight.detach(), None if lin.bias is None else lin.bias.detach(), ops)
    got = packed(x)
    assert got.dtype == torch.bfloat16 and got.shape == expected.shape
    # fp32 accumulation, one bf16 rounding: within a bf16 ulp of the exact product
    torch.testing.assert_close(got.float(), expected, rtol=2**-7, atol=1e-4)
    return ops.calls


@needs_gemv
@pytest.mark.parametrize("out_features,in_features", [(70, 33), (200, 96), (64, 32), (5, 1)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 12, 13, 16, 17, 24, 32, 33, 64, 301])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_equals_reference(out_features: int, in_features: int, rows: int, bias: bool) -> None:
    """1-4 rows take the GEMV's row loop, more take its tiles of 6 (full tiles, every tail size, and seven rows
    left at the end as one tile: 7, 13, 301); where AMX-BF16 is usable, 1-16 rows take one AMX tile of rows
    instead and 17-32 two. Every row count is given to the kernel, whatever it takes by itself on this CPU."""
    assert _gemv_vs_reference(out_features, in_features, (rows,), bias, max_rows=2**40) == 1


@needs_gemv
@pytest.mark.parametrize("rows,gemv,gemv_amx", [(1, True, True), (2, True, True), (4, True, True),
                                               (5, False, True), (16, False, True), (17, False, True),
                                               (32, False, True), (33, False, False), (64, False, False)])
def test_gemv_leaves_large_k_beyond_four_rows_to_onednn(rows: int, gemv: bool, gemv_amx: bool) -> None:
    """K past 2048 (padded): the weight block no longer fits L2 beside the next one, so oneDNN takes
    more than 4 rows. Where AMX-BF16 is usable, the kernel's AMX tiles take up to 32 rows at any K (they
    stream the weight once), and oneDNN more."""
    if OPS.gemv_sees_amx_bf16():
        assert OPS.packed_gemv_max_rows(2080) == OPS.packed_gemv_max_rows(64) == 32
        gemv = gemv_amx
    else:
        assert OPS.packed_gemv_max_rows(2080) == 4 and OPS.packed_gemv_max_rows(2048) > 2**40
    assert _gemv_vs_reference(70, 2080, (rows,), bias=True) == int(gemv)


@needs_gemv
def test_gemv_sees_amx_as_the_cpu_reports_it() -> None:
    """The kernel's AMX check agrees with the CPU flags Linux lists (amx_bf16) for this machine."""
    with open("/proc/cpuinfo") as f:
        flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    assert OPS.gemv_sees_amx_bf16() == ("amx_bf16" in flags and "amx_tile" in flags)


@needs_gemv
@pytest.mark.parametrize("out_features", [1280, 32000])
@pytest.mark.parametrize("rows", [1, 37])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_model_shapes(out_features: int, rows: int, bias: bool) -> None:
    assert _gemv_vs_reference(out_features, 768, (rows,), bias, max_rows=2**40) == 1


@needs_gemv
@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("rows", [3, 20, 50])
def test_gemv_threads_split_the_blocks(threads: int, rows: int) -> None:
    """Threads take ranges of 64-output blocks, and with fewer than 4 blocks per thread (6 here) ranges
    of rows within them as well: the same numbers as one thread, bitwise."""
    torch.manual_seed(rows)
    lin = nn.Linear(160, 330).to(torch.bfloat16)
    x = torch.randn(rows, 160, dtype=torch.bfloat16)
    packed = packed_linear(lin.weight.detach(), lin.bias.detach(), CountingOps(OPS, max_rows=2**40))
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
    lin = nn.Linear(96, 200).to(torch.bfloat16)
    packed = packed_linear(lin.weight.detach(), lin.bias.detach(), OPS)
    assert packed(torch.empty(0, 96, dtype=torch.bfloat16)).shape == (0, 200)


@needs_gemv
@pytest.mark.parametrize("shape", [(1, 1), (2, 2), (4, 1), (2, 3), (5, 7)])
def test_gemv_leading_dims(shape: tuple[int, ...]) -> None:
    assert _gemv_vs_reference(200, 96, shape, bias=True, max_rows=2**40) == 1


@pytest.mark.skipif(not HAS_GEMV, reason="no AVX512-BF16 packed GEMV")
def test_gemv_layout_probe_follows_the_packed_layout() -> None:
    """On: where oneDNN packs AB16b64a2b (this project's CI machine, Zen 5); off, without ever
    calling the GEMV on a buffer of another size, where it packs otherwise."""
    lin = nn.Linear(33, 70).to(torch.bfloat16)
    packed = packed_linear(lin.weight.detach(), lin.bias.detach())
    ab16b64a2b = int(torch.ops.mkldnn._nbytes(packed.weight)) == 128 * 64 * 2
    assert gemv_layout_ok(OPS) == ab16b64a2b


@needs_gemv
def test_method_enables_gemv_only_with_ops() -> None:
    lin = nn.Linear(96, 200, bias=False).to(torch.bfloat16)
    plain_method, fast_method = UnquantizedLinearMethod(), UnquantizedLinearMethod(OPS)
    plain = _loaded(Linear(96, 200, False, torch.bfloat16, plain_method), plain_method, lin)
    fast = _loaded(Linear(96, 200, False, torch.bfloat16, fast_method), fast_method, lin)
    assert plain.packed and plain.gemv_ops is None
    assert fast.packed and fast.gemv_ops is OPS and fast.gemv_max_rows > 0


class WrongLayoutOps:
    """A GEMV that reads the packed weight wrongly: the probe must catch it."""

    def has_packed_gemv(self) -> bool:
        return True

    def packed_gemv(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.zeros(x.shape[0], weight.shape[0], dtype=x.dtype)


def test_method_keeps_onednn_when_the_probe_fails() -> None:
    assert not gemv_layout_ok(WrongLayoutOps())
    method = UnquantizedLinearMethod(WrongLayoutOps())
    layer = _loaded(Linear(96, 200, False, torch.bfloat16, method), method,
                    nn.Linear(96, 200, bias=False).to(torch.bfloat16))
    assert layer.packed and layer.gemv_ops is None


needs_packer = pytest.mark.skipif(OPS is None, reason="tokenmill's C++ kernels are not built here")
PACKER_SHAPES = [(200, 96), (5, 3), (130, 33), (64, 64), (1, 7), (300, 70), (7, 2048)]


def _onednn_product(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


@needs_packer
@pytest.mark.parametrize("shape", PACKER_SHAPES)
@pytest.mark.parametrize("threads", [1, 2])
def test_packer_writes_the_bytes_of_onednns_reorder(shape: tuple[int, int], threads: int) -> None:
    """pack_ab16b64a2b against oneDNN's reorder, byte for byte, padding included: N and K off the blocks, odd K, K
    under one pair-chunk; the blocks split over threads."""
    torch.manual_seed(shape[0] * shape[1])
    weight = torch.randn(shape).to(torch.bfloat16)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert OPS.onednn_bytes_equal(pack_weight(weight), OPS.pack_ab16b64a2b(weight))
    finally:
        torch.set_num_threads(previous)


@needs_packer
@pytest.mark.parametrize("shape", PACKER_SHAPES)
def test_weight_packer_packs_a_shapes_later_weights_itself(shape: tuple[int, int]) -> None:
    """The first weight of a shape is oneDNN's reorder; the next ones are tokenmill's packer's bytes under oneDNN's
    descriptor, which oneDNN's product and the GEMV read as they read oneDNN's own packing."""
    torch.manual_seed(shape[0] + shape[1])
    packer = WeightPacker(OPS)
    first, second = (torch.randn(shape).to(torch.bfloat16) for _ in range(2))
    packed_first, storage_first = packer.pack(first)
    assert storage_first is None and packed_first.is_mkldnn
    packed, storage = packer.pack(second)
    reference = pack_weight(second)
    assert storage is not None and packed.is_mkldnn and tuple(packed.shape) == shape
    assert OPS.onednn_bytes_equal(reference, storage)
    assert torch.ops.mkldnn.data_ptr(packed) == storage.data_ptr()
    for rows in (1, 5, 64, 300):
        x = torch.randn(rows, shape[1]).to(torch.bfloat16)
        torch.testing.assert_close(_onednn_product(x, packed), _onednn_product(x, reference), rtol=0, atol=0)
        if HAS_GEMV and gemv_layout_ok(OPS):
            torch.testing.assert_close(OPS.packed_gemv(x, packed, None), OPS.packed_gemv(x, reference, None),
                                       rtol=0, atol=0)


class MisplacingPacker:
    """tokenmill's packer writing its bytes one output block late: the first weight's comparison must catch it."""

    def has_onednn_over(self) -> bool:
        return True

    def pack_ab16b64a2b(self, weight: torch.Tensor) -> torch.Tensor:
        assert OPS is not None
        return torch.roll(OPS.pack_ab16b64a2b(weight), 64 * 32)

    def onednn_bytes_equal(self, packed: torch.Tensor, storage: torch.Tensor) -> bool:
        assert OPS is not None
        return bool(OPS.onednn_bytes_equal(packed, storage))


@needs_packer
def test_weight_packer_keeps_onednn_where_the_bytes_differ() -> None:
    torch.manual_seed(2)
    packer = WeightPacker(MisplacingPacker())
    weights = [torch.randn(200, 96).to(torch.bfloat16) for _ in range(3)]
    for weight in weights:
        packed, storage = packer.pack(weight)
        assert storage is None and OPS.onednn_bytes_equal(packed, OPS.pack_ab16b64a2b(weight))


@needs_packer
def test_weight_packer_leaves_other_weights_to_onednn() -> None:
    """float32 weights (packed where oneDNN has no bf16 path) and non-contiguous ones go to oneDNN's reorder."""
    packer = WeightPacker(OPS)
    weight = torch.randn(96, 64)
    for _ in range(2):
        assert packer.pack(weight.to(torch.bfloat16).t().contiguous().t())[1] is None
        assert packer.pack(weight)[1] is None
    assert packer.pack(weight.to(torch.bfloat16))[1] is None  # its shape's first
    assert WeightPacker(None).pack(weight.to(torch.bfloat16))[1] is None


@needs_packer
def test_layers_keep_the_memory_their_packed_weight_reads() -> None:
    """A layer packed by tokenmill's packer holds the storage; the product reads it after every other reference to
    it is gone."""
    torch.manual_seed(3)
    method = UnquantizedLinearMethod(OPS)
    weights = [torch.randn(200, 96, dtype=torch.bfloat16) for _ in range(2)]
    layers = [Linear(96, 200, False, torch.bfloat16, method) for _ in weights]
    for layer, weight in zip(layers, weights, strict=True):
        layer.weight_loader(layer.weight, weight)
        method.process_weights_after_loading(layer)
    assert layers[0].packed_storage is None and layers[1].packed_storage is not None
    x = torch.randn(9, 96, dtype=torch.bfloat16)
    for layer, weight in zip(layers, weights, strict=True):
        torch.testing.assert_close(layer(x), _pack_reference(weight, None, x), rtol=0, atol=0)
