"""The quantized linear kernels (kernels/cpu/linear/quantized.cpp) against their torch references
(layers/quantization/reference.py), for every group size, symmetric and asymmetric int4, K off the
group and off the kernels' 16/32/64 runs, and N = 1..7 outputs and rows.

Tolerances: fp32 activations give fp32 sums in another order, so 1e-5 relative to the output's scale;
bf16 activations round the output to bf16 (2^-8 relative) and the reference multiplies a bf16-rounded
weight, so 2^-6 relative to the output's scale. AVX2 builds carry x as 16-bit fixed point (FIXED_POINT
below), which adds half a step per element times the weight row's magnitudes. W8A8's integer products
are exact in both, so its fp32 outputs match to the last bit, and bf16 ones to bf16 rounding."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tokenmill.kernels import load_cpu_kernels
from tokenmill.layers.quantization import ONEDNN_SRC_ZERO_POINT, onednn_int8_available, onednn_int8_product
from tokenmill.layers.quantization import reference as ref

OPS = load_cpu_kernels()
# int8_linear and int4_linear run on AVX-512 BW/VNNI and on AVX2 (fp32 x only there: bf16 x is widened to it);
# W8A8 needs VNNI
pytestmark = pytest.mark.skipif(OPS is None or not OPS.has_weight_only_linear(),
                                reason="quantized kernels unavailable (no AVX-512 BW/VNNI, no AVX2)")
needs_vnni = pytest.mark.skipif(OPS is None or not OPS.has_quantized_linear(),
                                reason="W8A8 kernels unavailable (no AVX-512 BW/VNNI)")
# (rows of x, outputs, K): K on and off the group and the 16/32/64 runs, 1 to 7 outputs, row tiles and tails;
# bf16 x of up to 16 rows takes the limb kernels (int4: K and group multiples of 128), 17 rows the float ones
SHAPES = [(1, 1, 32), (3, 7, 70), (7, 5, 200), (13, 33, 130), (4, 96, 256), (1, 9, 384), (6, 11, 512),
          (17, 6, 256)]


# AVX2 builds carry x as 16-bit fixed point per row (a step of amax / 32767, rounded to nearest), so each
# output may further differ by half a step times the sum of the weight row's magnitudes
FIXED_POINT = OPS is not None and OPS.has_weight_only_linear() and not OPS.has_quantized_linear()


def _close(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, magnitude: torch.Tensor,
           x: torch.Tensor | None = None, w: torch.Tensor | None = None) -> None:
    """magnitude: |x| @ |w|^T (+ |bias|), the size of the terms summed into each output; x and w (the
    dequantized weight) for the fixed-point bound."""
    tol = 1e-5 if dtype == torch.float32 else 2**-6
    bound = torch.full_like(expected.float(), tol * float(magnitude.max()) + 1e-6)
    if FIXED_POINT and x is not None and w is not None:
        step = x.float().abs().amax(1, keepdim=True) / 32767
        bound = bound + 0.5 * step * w.abs().sum(1)[None, :]
    excess = (got.float() - expected.float()).abs() - bound
    assert got.shape == expected.shape and bool((excess <= 0).all()), f"off by {float(excess.max())} past the bound"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_int8(m: int, n: int, k: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    q, scale = ref.rtn_int8(torch.randn(n, k, generator=gen))
    x = torch.randn(m, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    got = OPS.int8_linear(x, q, scale, ref.weight_sum(q), bias)
    assert got.dtype == dtype and got.shape == (m, n)
    w = ref.dequantize_int8(q, scale)
    _close(got, ref.linear_ref(x, w, bias), dtype, x.float().abs() @ w.abs().T + bias.float().abs(), x, w)


@pytest.mark.parametrize("group", [32, 64, 128, None])
@pytest.mark.parametrize("zero_point", [False, True])
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_int4(m: int, n: int, k: int, group: int | None, zero_point: bool) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    g = group or k
    q, scale, zero = ref.rtn_int4(torch.randn(n, k, generator=gen) + (0.3 if zero_point else 0), g, zero_point)
    packed = ref.pack_int4(q)
    assert torch.equal(ref.unpack_int4(packed, k), q)
    if not zero_point:  # symmetric: the layers keep no zero points (all 8)
        assert bool((zero == 8).all())
        zero = zero.new_empty(0)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(m, k, generator=gen).to(dtype)
        got = OPS.int4_linear(x, packed, scale, zero, k, g, None)
        w = ref.dequantize_int4(packed, scale, zero, k, g)
        _close(got, ref.linear_ref(x, w, None), dtype, x.float().abs() @ w.abs().T, x, w)


@needs_vnni
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_w8a8(m: int, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    q, scale = ref.rtn_int8(torch.randn(n, k, generator=gen))
    padded, wsum = ref.w8a8_layout(q)
    x = torch.randn(m, k, generator=gen)
    x[0] = 0.0  # an all-zero row: its scale is clamped, not a division by zero
    bias = torch.randn(n, generator=gen)
    got = OPS.w8a8_linear(x, padded, scale, wsum, k, bias)
    torch.testing.assert_close(got, ref.w8a8_ref(x, padded, scale, k, bias), rtol=0, atol=0)
    xb = x.bfloat16()
    _close(OPS.w8a8_linear(xb, padded, scale, wsum, k, bias.bfloat16()),
           ref.w8a8_ref(xb, padded, scale, k, bias.bfloat16()), torch.bfloat16,
           xb.float().abs() @ ref.dequantize_int8(q, scale).abs().T + bias.abs())


@pytest.mark.parametrize("m", range(1, 8))
def test_every_row_count(m: int) -> None:
    gen = torch.Generator().manual_seed(m)
    _check_int8_and_int4(torch.randn(m, 100, generator=gen), torch.randn(6, 100, generator=gen), 32)


def _check_int8_and_int4(x: torch.Tensor, w: torch.Tensor, group: int) -> None:
    """int8_linear, and int4_linear with zero points in groups of `group`, of fp32 x by w rounded to nearest."""
    k = w.shape[1]
    q, scale = ref.rtn_int8(w)
    w8 = ref.dequantize_int8(q, scale)
    _close(OPS.int8_linear(x, q, scale, ref.weight_sum(q), None), ref.linear_ref(x, w8, None), torch.float32,
           x.abs() @ w8.abs().T, x, w8)
    q4, s4, z4 = ref.rtn_int4(w, group, True)
    w4 = ref.dequantize_int4(ref.pack_int4(q4), s4, z4, k, group)
    _close(OPS.int4_linear(x, ref.pack_int4(q4), s4, z4, k, group, None), ref.linear_ref(x, w4, None),
           torch.float32, x.abs() @ w4.abs().T, x, w4)


@needs_vnni
@pytest.mark.parametrize("m", range(1, 8))
def test_every_row_count_w8a8(m: int) -> None:
    gen = torch.Generator().manual_seed(m)
    w, x = torch.randn(6, 100, generator=gen), torch.randn(m, 100, generator=gen)
    q, scale = ref.rtn_int8(w)
    padded, wsum = ref.w8a8_layout(q)
    expected = ref.w8a8_ref(x, padded, scale, 100, None)
    torch.testing.assert_close(OPS.w8a8_linear(x, padded, scale, wsum, 100, None), expected, rtol=0, atol=0)


@needs_vnni
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8a8_by_onednn_int8(dtype: torch.dtype) -> None:
    # the batches over W8A8_VNNI_MAX_ROWS: quantize_rows_uint8, oneDNN's int8 product, scale_rows; the integer
    # products are exact, the scaling is fp32 in another order (dots * w_scale, then * x_scale)
    if not onednn_int8_available():
        pytest.skip("oneDNN's int8 linear is not available in this torch")
    gen = torch.Generator().manual_seed(3)
    q, scale = ref.rtn_int8(torch.randn(40, 200, generator=gen))
    x = torch.randn(33, 200, generator=gen).to(dtype)
    bias = torch.randn(40, generator=gen).to(dtype)
    xq, xs = OPS.quantize_rows_uint8(x)
    expected_q, expected_s = ref.quantize_rows(x)
    assert xq.dtype == torch.uint8
    assert torch.equal(xq.float() - ONEDNN_SRC_ZERO_POINT, expected_q) and torch.equal(xs, expected_s)
    dots = onednn_int8_product(xq, torch.ops.onednn.qlinear_prepack(q, None), scale, torch.zeros(40, dtype=torch.int64))
    got = OPS.scale_rows(dots, xs, bias, dtype)
    padded, _ = ref.w8a8_layout(q)
    expected = ref.w8a8_ref(x, padded, scale, 200, bias)
    assert got.dtype == dtype
    magnitude = x.float().abs() @ ref.dequantize_int8(q, scale).abs().T + bias.float().abs()
    _close(got, expected, dtype, magnitude)


def test_w8a8_reference_is_close_to_the_float_product() -> None:
    gen = torch.Generator().manual_seed(1)
    w, x = torch.randn(48, 256, generator=gen), torch.randn(5, 256, generator=gen)
    q, scale = ref.rtn_int8(w)
    padded, _ = ref.w8a8_layout(q)
    y = ref.w8a8_ref(x, padded, scale, 256, None)
    expected = x @ w.T
    assert float((y - expected).norm() / expected.norm()) < 0.02


def test_kernels_check_their_input() -> None:
    q, scale = ref.rtn_int8(torch.randn(8, 64))
    with pytest.raises(RuntimeError, match="x must be"):
        OPS.int8_linear(torch.randn(2, 63), q, scale, ref.weight_sum(q), None)
    with pytest.raises(RuntimeError, match="group"):
        OPS.int4_linear(torch.randn(2, 64), torch.zeros(8, 32, dtype=torch.uint8), torch.ones(8, 2),
                        torch.ones(8, 2), 64, 48, None)


@pytest.mark.skipif(OPS is None or OPS.has_quantized_linear(), reason="this build has the W8A8 kernels")
def test_w8a8_ops_say_they_are_missing() -> None:
    q, scale = ref.rtn_int8(torch.randn(8, 64))
    padded, wsum = ref.w8a8_layout(q)
    with pytest.raises(RuntimeError, match="built without AVX512-BW/VNNI"):
        OPS.w8a8_linear(torch.randn(2, 64), padded, scale, wsum, 64, None)


def test_int8_and_int4_on_a_decoder_layer_shape() -> None:
    """One row against a 1.1B Llama's MLP shape: many NR-row blocks and the prefetch past them."""
    gen = torch.Generator().manual_seed(7)
    _check_int8_and_int4(torch.randn(1, 2048, generator=gen), torch.randn(5632, 2048, generator=gen) * 0.02, 128)


@pytest.mark.parametrize("n,k,group,zero_point", [(7, 100, 32, False), (33, 256, 128, True), (64, 2048, 128, False),
                                                  (5, 70, 70, True), (16, 130, 64, True), (3, 64, None, False)])
def test_dequantize_bf16_is_the_reference_rounded(n: int, k: int, group: int | None, zero_point: bool) -> None:
    # the weight the layers multiply more than KERNEL_MAX_ROWS rows by: the reference's float32 values rounded to
    # bf16, bit for bit, for int4 (with and without zero points, K off the group and off 32) and int8
    gen = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=gen) + (0.3 if zero_point else 0)
    g = group or k
    q, scale, zero = ref.rtn_int4(w, g, zero_point)
    packed = ref.pack_int4(q)
    zero = zero if zero_point else zero.new_empty(0)
    assert torch.equal(OPS.dequantize_bf16(packed, scale, zero, k, g),
                       ref.dequantize_int4(packed, scale, zero, k, g).bfloat16())
    q8, s8 = ref.rtn_int8(w)
    assert torch.equal(OPS.dequantize_bf16(q8, s8, s8.new_empty(0), k, 0), ref.dequantize_int8(q8, s8).bfloat16())


needs_amx = pytest.mark.skipif(OPS is None or not OPS.has_dequant_amx(),
                               reason="no AMX-BF16 here: bf16 batches over 16 rows keep the dequantized weight")


@needs_amx
@pytest.mark.parametrize("m", [17, 32, 33, 47, 100, 256])
@pytest.mark.parametrize("n,k,group,zero_point", [(70, 96, 32, False), (33, 200, 64, True), (64, 256, 128, False),
                                                  (5, 50, None, True), (129, 1024, 128, True),
                                                  (40, 2304, 128, True), (37, 4100, 64, False)])
def test_dequantized_amx_rows(m: int, n: int, k: int, group: int | None, zero_point: bool) -> None:
    # bf16 batches over KERNEL_MAX_ROWS up to AMX_MAX_ROWS (dequant_amx.cpp): the reference's bf16 weight, a
    # block of 32 outputs at a time, times x in AMX tiles; outputs off the 32-output blocks and the 16-row
    # tiles, K off 32 and off the group; K of 2304 and 4100 take K in slices past 128 and 256 rows (x over 1 MiB)
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k, generator=gen) + (0.3 if zero_point else 0)
    x = torch.randn(m, k, generator=gen).bfloat16()
    bias = torch.randn(n, generator=gen).bfloat16()
    q8, s8 = ref.rtn_int8(w)
    w8 = ref.dequantize_int8(q8, s8).bfloat16()
    got = OPS.int8_linear(x, q8, s8, ref.weight_sum(q8), bias)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    _close(got, ref.linear_ref(x, w8, bias), torch.bfloat16, x.float().abs() @ w8.float().abs().T + bias.float().abs())
    g = group or k
    q4, s4, z4 = ref.rtn_int4(w, g, zero_point)
    z4 = z4 if zero_point else z4.new_empty(0)
    packed = ref.pack_int4(q4)
    w4 = ref.dequantize_int4(packed, s4, z4, k, g).bfloat16()
    got = OPS.int4_linear(x, packed, s4, z4, k, g, None)
    _close(got, ref.linear_ref(x, w4, None), torch.bfloat16, x.float().abs() @ w4.float().abs().T)


@needs_vnni
def test_onednn_runs_the_w8a8_product_with_a_kernel_of_its_own(capfd: pytest.CaptureFixture[str]) -> None:
    # oneDNN's verbose lines name the implementation it chose; with an int8 source and no AMX-INT8 that was
    # "ref_int8", its reference loop (about 1,000x slower), which the uint8 source avoids
    if not onednn_int8_available():
        pytest.skip("oneDNN's int8 linear is not available in this torch")
    gen = torch.Generator().manual_seed(5)
    q, scale = ref.rtn_int8(torch.randn(64, 256, generator=gen))
    packed = torch.ops.onednn.qlinear_prepack(q, None)
    xq, _ = OPS.quantize_rows_uint8(torch.randn(48, 256, generator=gen))
    capfd.readouterr()
    with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
        onednn_int8_product(xq, packed, scale, torch.zeros(64, dtype=torch.int64))
    lines = [line for line in capfd.readouterr().out.splitlines() if ",exec,cpu,matmul," in line]
    assert lines, "oneDNN printed no matmul line"
    assert all("ref" not in line.split(",")[6] for line in lines), lines


# One bf16 row of x against int8 and int4 weights (group 128 symmetric and with zero points, group 256), N odd and
# even, K with a tail: each output of one process, which takes the weight rows in the order TOKENMILL_QUANT_ROWS
# names (`stream`: the two halves read at once, AMD's default; `blocks`: rows side by side, Intel's)
_ROW_ORDER_SHAPES = [(1, 256), (2, 384), (9, 384), (33, 512), (40, 200), (77, 1024)]  # (N, K)
_ROW_ORDER_GROUPS = [(128, False), (128, True), (256, True)]  # (group, zero points)
_ROW_ORDER_SCRIPT = f"""
import sys, torch
from tokenmill.kernels import load_cpu_kernels
from tokenmill.layers.quantization import reference as ref
ops = load_cpu_kernels()
torch.set_num_threads(int(sys.argv[2]))
SHAPES, GROUPS = {_ROW_ORDER_SHAPES!r}, {_ROW_ORDER_GROUPS!r}
gen = torch.Generator().manual_seed(7)
out = []
for n, k in SHAPES:
    w, x = torch.randn(n, k, generator=gen), torch.randn(1, k, generator=gen).bfloat16()
    q, scale = ref.rtn_int8(w)
    out.append(ops.int8_linear(x, q, scale, ref.weight_sum(q), None))
    for group, zero_point in GROUPS:
        if k % group == 0:
            q4, s4, z4 = ref.rtn_int4(w, group, zero_point)
            zeros = z4 if zero_point else z4.new_empty(0)
            out.append(ops.int4_linear(x, ref.pack_int4(q4), s4, zeros, k, group, None))
torch.save(out, sys.argv[1])
"""


@pytest.mark.skipif(OPS is None or not OPS.has_quantized_linear(), reason="no AVX-512 limb kernels here")
def test_one_row_kernels_give_the_same_outputs_in_either_row_order(tmp_path: Path) -> None:
    outputs = {}
    for order in ("stream", "blocks"):
        for threads in (1, 2):
            path = tmp_path / f"{order}-{threads}.pt"
            env = {**os.environ, "TOKENMILL_QUANT_ROWS": order}
            subprocess.run([sys.executable, "-c", _ROW_ORDER_SCRIPT, str(path), str(threads)], env=env, check=True)
            outputs[order, threads] = torch.load(path)
    first = outputs["stream", 1]
    assert len(first) == 19
    for got in outputs.values():
        assert all(torch.equal(a, b) for a, b in zip(got, first, strict=True))
    # and the stream kernels' outputs against the reference (the blocks' are checked above, shape by shape)
    gen = torch.Generator().manual_seed(7)
    i = 0
    for n, k in _ROW_ORDER_SHAPES:
        w, x = torch.randn(n, k, generator=gen), torch.randn(1, k, generator=gen).bfloat16()
        q, scale = ref.rtn_int8(w)
        w8 = ref.dequantize_int8(q, scale)
        _close(first[i], ref.linear_ref(x, w8, None), torch.bfloat16, x.float().abs() @ w8.abs().T)
        i += 1
        for group, zero_point in _ROW_ORDER_GROUPS:
            if k % group == 0:
                q4, s4, z4 = ref.rtn_int4(w, group, zero_point)
                w4 = ref.dequantize_int4(ref.pack_int4(q4), s4, z4, k, group)
                _close(first[i], ref.linear_ref(x, w4, None), torch.bfloat16, x.float().abs() @ w4.abs().T)
                i += 1
