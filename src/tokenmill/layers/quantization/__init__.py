"""Quantized linear methods: W8A16 int8 per output channel, W4A16 int4 group-wise (symmetric or with
zero points), W8A8 (int8 weights, dynamic per-token int8 activations), read from compressed-tensors,
GPTQ and AWQ checkpoints or quantized at load by round-to-nearest (`quantization_config.py`).

A `QuantizedLinearMethod` registers the checkpoint format's parameters (`formats.py`), turns them after
loading into the layout tokenmill's kernels read (`reference.py`) and drops them, so no float copy of
a weight stays in memory. `apply` runs the C++ kernels (kernels/cpu/linear/quantized.cpp), which
dequantize in registers, where they are built and the CPU runs them (`quantized_kernels`: every scheme
with AVX-512 BW and VNNI; W8A16 and W4A16 with AVX2 and FMA, x as 16-bit fixed point). W8A16/W4A16 batches
of bf16 rows over KERNEL_MAX_ROWS run the same ops where they have AMX-BF16 (up to AMX_MAX_ROWS: the weight
dequantized 32 outputs at a time into AMX tiles); elsewhere, and beyond, a weight dequantized for the call,
then a float matmul. W8A8 batches over W8A8_VNNI_MAX_ROWS rows run oneDNN's int8 matmul on a second,
oneDNN-packed copy of the weight (the same integer products; AMX on CPUs that have it). The lm_head
(`lm_head_method`) stays a float layer, as the formats leave it, except under `QuantConfig.lm_head` (the
rounding methods int8 and int4): then it is rounded to int8 per output row like an int8 projection.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tokenmill.cpu_features import cpu_flags
from tokenmill.layers.linear import LinearBase, LinearMethod, UnquantizedLinearMethod, in_onednn_rows
from tokenmill.layers.quantization import formats
from tokenmill.layers.quantization import reference as ref
from tokenmill.quantization_config import QuantConfig

logger = logging.getLogger(__name__)
KERNEL_MAX_ROWS = 16  # W8A16/W4A16: rows the VNNI kernels take; larger batches are compute-bound matmuls
# W8A16/W4A16, bf16 rows, where the ops run AMX-BF16 (has_dequant_amx): the most rows the ops take, the weight
# dequantized 32 outputs at a time into AMX tiles (kernels/cpu/linear/dequant_amx.cpp)
AMX_MAX_ROWS = 256
W8A8_VNNI_MAX_ROWS = 16  # W8A8: rows the VNNI kernel takes; oneDNN's int8 matmul (AMX where there is one) beyond
REQUIRED_CPU_FLAGS = ("avx512bw", "avx512_vnni")  # every kernel: W8A8 and bf16 activations' VNNI products
WEIGHT_ONLY_CPU_FLAGS = ("avx2", "fma")  # int8 and int4 (W8A16/W4A16), x as 16-bit fixed point


def quantized_kernels(ops: Any, scheme: str) -> Any:
    """ops where its kernels for `scheme` (int8, int4, w8a8) are built and this CPU runs them, else None
    (logged): every scheme with AVX-512 BW/VNNI, int8 and int4 with AVX2 and FMA."""
    if ops is None:
        return None
    flags = cpu_flags()
    if all(f in flags for f in REQUIRED_CPU_FLAGS) and ops.has_quantized_linear():
        return ops
    if scheme != "w8a8" and all(f in flags for f in WEIGHT_ONLY_CPU_FLAGS) and ops.has_weight_only_linear():
        return ops
    needs = REQUIRED_CPU_FLAGS if scheme == "w8a8" else WEIGHT_ONLY_CPU_FLAGS
    logger.info("%s linear kernels unavailable (this CPU or build lacks %s); using the torch reference path",
                scheme, " or ".join(needs))
    return None


# the source's zero point in oneDNN's int8 products: rows quantized to int8 are passed as uint8 plus 128
# (quantize_rows_uint8), as torch's own quantized linear passes them. oneDNN multiplies an int8 source only with
# AMX-INT8; elsewhere (AVX-512 VNNI) it took its reference implementation, about 1,000x slower
ONEDNN_SRC_ZERO_POINT = 128


def onednn_int8_product(xq: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                        zeros: torch.Tensor) -> torch.Tensor:
    """float32 [M, N]: xq (uint8 [M, K], zero point ONEDNN_SRC_ZERO_POINT) times a qlinear_prepack'ed int8
    weight, each output column times its scale."""
    return torch.ops.onednn.qlinear_pointwise(xq, 1.0, ONEDNN_SRC_ZERO_POINT, packed, scales, zeros, None, 1.0, 0,
                                              torch.float32, "none", [], "")


@functools.lru_cache(maxsize=1)
def onednn_int8_available() -> bool:
    """Whether this torch has oneDNN's int8 linear ops (onednn.qlinear_prepack / qlinear_pointwise) and
    they run here."""
    try:
        packed = torch.ops.onednn.qlinear_prepack(torch.ones(16, 64, dtype=torch.int8), None)
        xq = torch.full((2, 64), 1 + ONEDNN_SRC_ZERO_POINT, dtype=torch.uint8)
        y = onednn_int8_product(xq, packed, torch.ones(16), torch.zeros(16, dtype=torch.int64))
        return bool((y == 64).all())
    except (RuntimeError, AttributeError):
        return False


def _set(layer: LinearBase, name: str, t: torch.Tensor) -> None:
    setattr(layer, name, nn.Parameter(t.contiguous(), requires_grad=False))


def _t(layer: LinearBase, name: str) -> torch.Tensor:
    t = getattr(layer, name)
    assert isinstance(t, torch.Tensor), name
    return t


@dataclass(frozen=True)
class QuantLayout:
    """What a quantized layer's kernels need besides its tensors."""

    scheme: str
    group_size: int = 0  # int4
    input_perm: torch.Tensor | None = None  # GPTQ act-order: x's columns in this order


def layout_of(layer: LinearBase) -> QuantLayout:
    layout = layer.__dict__.get("quant_layout")
    if not isinstance(layout, QuantLayout):
        raise ValueError("the layer's quantized weights are not processed yet")
    return layout


class QuantizedLinearMethod:
    """One LinearMethod for every format and scheme of `cfg`. `ops`: tokenmill's C++ CPU kernels (or
    None: the reference path). `lm_head_ops`: what a float lm_head's method gets."""

    def __init__(self, cfg: QuantConfig, ops: Any = None, lm_head_ops: Any = None, split_rows: bool = False) -> None:
        self.cfg = cfg
        self.ops = ops  # (its rounding ops are portable C++: they serve where the linear kernels do not run)
        self.kernels = quantized_kernels(ops, cfg.scheme)
        # split_rows: batches over AMX_MAX_ROWS bf16 rows go through the AMX op AMX_MAX_ROWS rows at a time, not
        # through a whole dequantized weight (the int8 lm_head's: the largest weight, rarely over that many rows)
        self.split_rows = split_rows
        self.lm_head_method: LinearMethod = (
            QuantizedLinearMethod(QuantConfig("rtn", "int8"), ops, split_rows=True) if cfg.lm_head
            else UnquantizedLinearMethod(lm_head_ops))

    def create_weights(self, layer: LinearBase, dtype: torch.dtype) -> None:
        formats.create_checkpoint_params(self.cfg, layer, dtype)

    def repacks(self, layer: LinearBase) -> bool:
        # the rounding methods read the loaded float weight once and keep only the integers they make of it; a
        # checkpoint format's tensors are read as they are
        return self.cfg.format == "rtn"

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        w = formats.to_int_weights(self.cfg, layer, self.ops)
        for name in formats.checkpoint_param_names(layer):
            delattr(layer, name)
        group = 0
        if self.cfg.scheme == "int4":
            if w.zero is None:
                raise ValueError("int4 weights without zero points")
            if not w.packed and int(w.q.max()) > 15:
                raise ValueError("int4 weights hold values over 15 (is the checkpoint 4-bit?)")
            _set(layer, "qweight", w.q if w.packed else ref.pack_int4(w.q))
            symmetric = bool((w.zero == 8).all())  # then the kernels read no zero points
            _set(layer, "zeros", w.zero.new_empty(0).float() if symmetric else w.zero.float())
            group = formats.group_of(self.cfg, layer.input_size)
        elif self.cfg.scheme == "w8a8":
            padded, wsum = ref.w8a8_layout(w.q, w.wsum)
            _set(layer, "qweight", padded)
            _set(layer, "weight_sum", wsum)
            if self.kernels is not None and onednn_int8_available():
                # a second int8 copy, in oneDNN's packed layout, for the compute-bound batches
                layer.onednn_qweight = nn.Parameter(torch.ops.onednn.qlinear_prepack(w.q.contiguous(), None),
                                                    requires_grad=False)
                layer.__dict__["onednn_zero"] = torch.zeros(w.q.shape[0], dtype=torch.int64)
        else:
            _set(layer, "qweight", w.q)
            _set(layer, "weight_sum", w.wsum if w.wsum is not None else ref.weight_sum(w.q))
        _set(layer, "scales", w.scale.float())
        perm = w.perm.to(w.scale.device) if w.perm is not None else None
        layer.__dict__["quant_layout"] = QuantLayout(self.cfg.scheme, group, perm)

    def dequantized_weight(self, layer: LinearBase) -> torch.Tensor:
        """The fp32 [N, K] weight this layer multiplies by (in the checkpoint's column order)."""
        layout = layout_of(layer)
        if layout.scheme == "int4":
            w = ref.dequantize_int4(_t(layer, "qweight"), _t(layer, "scales"), _t(layer, "zeros"), layer.input_size,
                                    layout.group_size)
            return w if layout.input_perm is None else w[:, torch.argsort(layout.input_perm)]
        return ref.dequantize_int8(_t(layer, "qweight")[:, :layer.input_size], _t(layer, "scales"))

    def max_rows(self, dtype: torch.dtype) -> int:
        """The most rows of `dtype` the int8/int4 ops take (beyond them, a dequantized weight's matmul)."""
        return AMX_MAX_ROWS if dtype == torch.bfloat16 and self.dequant_amx else KERNEL_MAX_ROWS

    @functools.cached_property
    def dequant_amx(self) -> bool:
        return self.kernels is not None and bool(self.kernels.has_dequant_amx())

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        layout = layout_of(layer)
        rows = x.reshape(-1, layer.input_size)
        kernels = self.kernels if rows.device.type == "cpu" and rows.dtype in (torch.bfloat16, torch.float32) else None
        if self.split_rows and kernels is not None and self.max_rows(rows.dtype) == AMX_MAX_ROWS < rows.shape[0]:
            parts = [self.apply(layer, r) for r in rows.split(AMX_MAX_ROWS)]
            return torch.cat(parts).view(*x.shape[:-1], layer.output_size)
        q, scales, k, bias = _t(layer, "qweight"), _t(layer, "scales"), layer.input_size, layer.bias
        if layout.scheme == "w8a8":
            if kernels is not None and rows.shape[0] > W8A8_VNNI_MAX_ROWS and hasattr(layer, "onednn_qweight"):
                # the same integer products by oneDNN, each row's scale after
                xq, xs = kernels.quantize_rows_uint8(rows.contiguous())
                packed, zeros = _t(layer, "onednn_qweight"), layer.__dict__["onednn_zero"]
                dots = in_onednn_rows(lambda r: onednn_int8_product(r, packed, scales, zeros), xq)
                y = kernels.scale_rows(dots, xs, bias, rows.dtype)
            else:
                y = (kernels.w8a8_linear(rows, q, scales, _t(layer, "weight_sum"), k, bias) if kernels is not None
                     else ref.w8a8_ref(rows, q, scales, k, bias))
        elif kernels is None or rows.shape[0] > self.max_rows(rows.dtype):
            x_in = rows if layout.input_perm is None else rows[:, layout.input_perm]
            if kernels is not None and rows.dtype == torch.bfloat16:  # oneDNN's bf16 product: see in_onednn_rows
                # the reference's weight as linear_ref rounds it to bf16, made in one pass (in the checkpoint's column
                # order where x_in is permuted)
                aux = _t(layer, "zeros") if layout.scheme == "int4" else scales.new_empty(0)
                w = kernels.dequantize_bf16(q, scales, aux, k, layout.group_size)
                y = in_onednn_rows(lambda r: ref.linear_ref(r, w, bias), x_in)
            else:
                w = (self.dequantized_weight(layer) if layout.input_perm is None
                     else ref.dequantize_int4(q, scales, _t(layer, "zeros"), k, layout.group_size))
                y = ref.linear_ref(x_in, w, bias)
        elif layout.scheme == "int8":
            y = kernels.int8_linear(rows, q, scales, _t(layer, "weight_sum"), bias)
        else:
            if layout.input_perm is not None:
                rows = rows[:, layout.input_perm]
            y = kernels.int4_linear(rows, q, scales, _t(layer, "zeros"), k, layout.group_size, bias)
        out: torch.Tensor = y.view(*x.shape[:-1], layer.output_size)
        return out


# the fused decode loop's projection kinds (kernels/cpu/fused_decode/decode_layers.cpp, enum Kind)
FUSED_KINDS = {"int8": 1, "int4": 2, "w8a8": 3}


@dataclass(frozen=True)
class FusedProjection:
    """What the fused decode loop calls for one quantized layer: the op `apply` calls, on these tensors."""

    weight: torch.Tensor
    # scales; the row sums (int8, W8A8) or zero points (int4); W8A8's oneDNN-packed weight and zero points
    # (empty tensors elsewhere)
    quant: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
    # FUSED_KINDS[scheme], in_features, and int4's group or the most rows W8A8 gives its VNNI kernel (oneDNN's
    # int8 matmul beyond, where the layer has its packed weight)
    kind: tuple[int, int, int]
    max_rows: int | None  # the most rows `apply` gives to that op (beyond them, the torch reference)


def fused_projection(layer: LinearBase) -> FusedProjection | None:
    """The layer as the fused decode loop runs it, or None where `apply` does not run a C++ kernel for
    it (no kernels, GPTQ act-order's column order)."""
    method = layer.method
    if not isinstance(method, QuantizedLinearMethod) or method.kernels is None:
        return None
    layout = layout_of(layer)
    if layout.input_perm is not None:
        return None
    aux = _t(layer, "zeros") if layout.scheme == "int4" else _t(layer, "weight_sum")
    empty = aux.new_empty(0)
    if layout.scheme == "w8a8":  # every row count, as apply runs it
        onednn = ((layer.onednn_qweight, layer.__dict__["onednn_zero"]) if hasattr(layer, "onednn_qweight")
                  else (empty, empty))
        return FusedProjection(_t(layer, "qweight"), (_t(layer, "scales"), aux, *onednn),
                               (FUSED_KINDS["w8a8"], layer.input_size, W8A8_VNNI_MAX_ROWS), None)
    return FusedProjection(_t(layer, "qweight"), (_t(layer, "scales"), aux, empty, empty),
                           (FUSED_KINDS[layout.scheme], layer.input_size, layout.group_size),
                           method.max_rows(torch.bfloat16))


def reference_method(cfg: QuantConfig) -> QuantizedLinearMethod:
    """The method with its kernels off: the torch reference path."""
    return QuantizedLinearMethod(cfg, None)
