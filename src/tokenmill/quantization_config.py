"""What a checkpoint's weights are quantized to, and how they are stored: read once at start-up from
`quantization_config` in config.json, or from `--quantization` (vLLM's flag and names).

- `compressed-tensors`: int8 per output channel (W8A16, or W8A8 with dynamic per-token int8
  activations) and pack-quantized int4 (group-wise or per channel, symmetric or with zero points),
  as the `compressed-tensors` library writes them.
- `gptq` (`qweight/qzeros/scales/g_idx`, with or without act-order) and `awq` (GEMM packing), 4 bits.
- `int8`, `int4`, `w8a8`: tokenmill's round-to-nearest of a float checkpoint at load. `int8` and `int4` round
  the lm_head too, to int8 per output row (`QuantConfig.lm_head`), as llama.cpp's quantizer rounds its output
  matrix: at batch 1 the lm_head is a large share of the bytes a step reads (a vocabulary times the hidden
  size, against the layers' half or one byte a weight). The checkpoint formats leave it as they store it (float).

This module imports no torch (the engine config validates with it before any model is built).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

CHECKPOINT_METHODS = ("compressed-tensors", "gptq", "awq")
RTN_METHODS = ("int8", "int4", "w8a8")
RTN_LM_HEAD_METHODS = ("int8", "int4")  # the rounding methods that round the lm_head too (to int8)
QUANTIZATION_METHODS = CHECKPOINT_METHODS + RTN_METHODS
SCHEMES = ("int8", "int4", "w8a8")  # W8A16 per channel, W4A16 group-wise, W8A8 per channel x per token
RTN_INT4_GROUP = 128
# the kernels' layouts pad K to a multiple of these (layers/quantization/reference.py makes them; ModelCost counts them)
INT4_K_ALIGN = 32
W8A8_K_ALIGN = 64


def round_up(n: int, m: int) -> int:
    """n rounded up to a multiple of m."""
    return -(-n // m) * m


@dataclass(frozen=True)
class QuantConfig:
    """format: compressed-tensors | gptq | awq | rtn. scheme: int8 | int4 | w8a8. group_size: None
    for one scale per output channel. zero_point: int4 with zero points (asymmetric). act_order:
    GPTQ's g_idx may permute the groups. gptq_zero_offset: GPTQ's v1 checkpoints store zero - 1. lm_head: the
    lm_head is rounded to int8 per output row at load (the rounding methods int8 and int4)."""

    format: str
    scheme: str
    group_size: int | None = None
    zero_point: bool = False
    act_order: bool = False
    gptq_zero_offset: int = 0
    lm_head: bool = False

    @property
    def bits(self) -> int:
        return 4 if self.scheme == "int4" else 8


def resolve_quantization(model_dir: str, quantization: str | None) -> QuantConfig | None:
    """The checkpoint's quantization, with `quantization` (a name of QUANTIZATION_METHODS) overriding
    the detection; None for a float model. ValueError says what does not fit."""
    if quantization is not None and quantization not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization {quantization!r} unknown; choose from {list(QUANTIZATION_METHODS)}")
    qc = _checkpoint_quantization_config(model_dir)
    if quantization in RTN_METHODS:
        if qc is not None:
            raise ValueError(f"--quantization {quantization} quantizes a float checkpoint at load, but this one is "
                             f"already quantized ({qc.get('quant_method')!r}); leave --quantization out")
        group = RTN_INT4_GROUP if quantization == "int4" else None
        return QuantConfig("rtn", quantization, group_size=group, lm_head=quantization in RTN_LM_HEAD_METHODS)
    if qc is None:
        if quantization is not None:
            raise ValueError(f"--quantization {quantization}: config.json has no quantization_config")
        return None
    method = qc.get("quant_method")
    if quantization is not None and method != quantization:
        raise ValueError(f"--quantization {quantization}, but the checkpoint's quantization_config says "
                         f"quant_method {method!r}")
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method == "gptq":
        return _gptq(qc)
    if method == "awq":
        return _awq(qc)
    raise ValueError(f"quantization_config.quant_method {method!r} is not supported; tokenmill reads "
                     f"{list(CHECKPOINT_METHODS)}")


def _checkpoint_quantization_config(model_dir: str) -> dict[str, Any] | None:
    path = os.path.join(model_dir, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            qc = json.load(f).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        return None  # the architecture loader reports an unreadable config.json
    if qc is not None and not isinstance(qc, dict):
        raise ValueError("config.json quantization_config must be an object")
    return qc


def _bits(value: Any, allowed: tuple[int, ...], where: str) -> int:
    if value not in allowed:
        raise ValueError(f"{where} {value!r} is not supported (tokenmill reads {list(allowed)} bits)")
    return int(value)


def _group(value: Any, where: str) -> int | None:
    if value is None or value == -1:
        return None
    if not isinstance(value, int) or value < 1 or value % 32:
        raise ValueError(f"{where} {value!r} is not supported (a multiple of 32, or -1 for one group per row)")
    return value


def _gptq(qc: dict[str, Any]) -> QuantConfig:
    _bits(qc.get("bits"), (4,), "gptq quantization_config.bits")
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"gptq quantization_config.checkpoint_format {fmt!r} is not supported (gptq, gptq_v2)")
    return QuantConfig("gptq", "int4", _group(qc.get("group_size"), "gptq quantization_config.group_size"),
                       zero_point=not qc.get("sym", True), act_order=bool(qc.get("desc_act", False)),
                       gptq_zero_offset=1 if fmt == "gptq" else 0)


def _awq(qc: dict[str, Any]) -> QuantConfig:
    _bits(qc.get("bits", qc.get("w_bit")), (4,), "awq quantization_config.bits")
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"awq quantization_config.version {version!r} is not supported (gemm)")
    group = _group(qc.get("group_size", qc.get("q_group_size")), "awq quantization_config.group_size")
    return QuantConfig("awq", "int4", group, zero_point=bool(qc.get("zero_point", True)))


def _compressed_tensors(qc: dict[str, Any]) -> QuantConfig:
    groups = qc.get("config_groups") or {}
    schemes = list(groups.values()) if isinstance(groups, dict) else []
    if not schemes or any(s != schemes[0] for s in schemes):
        raise ValueError("compressed-tensors quantization_config.config_groups must hold one scheme (tokenmill "
                         "reads one scheme for every Linear)")
    unsupported = [name for name in qc.get("ignore") or [] if not str(name).endswith("lm_head")]
    if unsupported:
        raise ValueError(f"compressed-tensors quantization_config.ignore {unsupported} is not supported (only "
                         "lm_head may stay unquantized)")
    scheme = schemes[0]
    weights, acts = scheme.get("weights") or {}, scheme.get("input_activations")
    fmt = scheme.get("format") or qc.get("format")
    where = "compressed-tensors quantization_config.config_groups weights"
    if weights.get("type", "int") != "int":
        raise ValueError(f"{where}.type {weights.get('type')!r} is not supported (int)")
    bits = _bits(weights.get("num_bits"), (4, 8), f"{where}.num_bits")
    strategy = weights.get("strategy")
    if strategy not in ("channel", "group"):
        raise ValueError(f"{where}.strategy {strategy!r} is not supported (channel, group)")
    group = _group(weights.get("group_size"), f"{where}.group_size") if strategy == "group" else None
    symmetric = bool(weights.get("symmetric", True))
    if weights.get("actorder") not in (None, False, "static", "weight"):
        raise ValueError(f"{where}.actorder {weights.get('actorder')!r} is not supported (static or none)")
    if bits == 4:
        if fmt != "pack-quantized":
            raise ValueError(f"compressed-tensors 4-bit format {fmt!r} is not supported (pack-quantized)")
        if acts is not None:
            raise ValueError("compressed-tensors 4-bit weights with quantized activations are not supported")
        return QuantConfig("compressed-tensors", "int4", group, zero_point=not symmetric)
    if fmt not in ("int-quantized", "naive-quantized"):
        raise ValueError(f"compressed-tensors 8-bit format {fmt!r} is not supported (int-quantized)")
    if not symmetric or group is not None:
        raise ValueError(f"{where}: tokenmill reads symmetric int8 weights with one scale per output channel")
    if acts is None:
        return QuantConfig("compressed-tensors", "int8")
    if (acts.get("num_bits"), acts.get("type", "int"), acts.get("strategy"), acts.get("dynamic")) != (
            8, "int", "token", True) or not acts.get("symmetric", True):
        raise ValueError("compressed-tensors input_activations are supported as dynamic symmetric int8 per token "
                         f"only, got {acts}")
    return QuantConfig("compressed-tensors", "w8a8")
