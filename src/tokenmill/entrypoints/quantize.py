"""`tokenmill quantize`: a float checkpoint to a compressed-tensors checkpoint (the `compressed-tensors`
library's packing and its QuantizationConfig schema in config.json), which tokenmill, vLLM and
transformers load.

Methods: int8 (W8A16, one scale per output channel), int4 (W4A16, symmetric, one scale per group of
input columns), w8a8 (int8 weights per channel, dynamic int8 activations per token). Without a
calibration text every weight is rounded to nearest. With one (`--calibration FILE`), the text is run
through the float model (transformers) to collect each projection's input statistics, and
- int8 / int4: GPTQ (layers/quantization/gptq.py) with each layer's Hessian from the float model;
- w8a8: SmoothQuant's scale migration (alpha 0.5): each input column of q/k/v and gate/up is divided by
  s_j = max|x_j|^a / max|W_j|^(1-a) in the RMSNorm before them and multiplied into the weights, which
  flattens the activations' outliers before they are rounded to int8; then round-to-nearest.
The embeddings, norms and lm_head stay in the checkpoint's float dtype.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from typing import Any

import torch

from tokenmill.layers.quantization.gptq import HessianAccumulator, gptq_quantize
from tokenmill.models.loader import iterate_checkpoint

QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
METHODS = ("int8", "int4", "w8a8")
SMOOTH_ALPHA = 0.5
# the projections reading one RMSNorm's output: SmoothQuant divides that norm's weight
SMOOTHED = {"input_layernorm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            "post_attention_layernorm": ("mlp.gate_proj", "mlp.up_proj")}


@dataclass(frozen=True)
class QuantizeOptions:
    method: str
    group_size: int = 128
    calibration: str | None = None  # a text file
    calibration_tokens: int = 8192
    window: int = 512


def quantize_checkpoint(model_dir: str, out_dir: str, opts: QuantizeOptions) -> dict[str, Any]:
    """Write the quantized checkpoint to out_dir; returns its quantization_config."""
    if opts.method not in METHODS:
        raise ValueError(f"method {opts.method!r} unknown; choose from {list(METHODS)}")
    if opts.method == "int4" and (opts.group_size < 32 or opts.group_size % 32):
        raise ValueError(f"group size {opts.group_size} is not supported (a multiple of 32)")
    try:
        from compressed_tensors.quantization import QuantizationConfig  # noqa: F401
    except ImportError:
        raise ValueError("tokenmill quantize writes with the compressed-tensors library: pip install "
                         "compressed-tensors") from None
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    if "quantization_config" in config:
        raise ValueError(f"{model_dir!r} is already quantized")
    tensors = dict(iterate_checkpoint(model_dir))
    stats = _calibrate(model_dir, opts) if opts.calibration else None
    if stats is not None and opts.method == "w8a8":
        _smooth(tensors, stats)
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith(".weight") and name.split(".")[-2] in QUANTIZED:
            module = name.removesuffix(".weight")
            hessian = stats[module].hessian() if stats is not None and opts.method != "w8a8" else None
            out.update({f"{module}.{k}": v for k, v in _quantize(t, opts, hessian).items()})
        else:
            out[name] = t.contiguous()
    qconfig = _quantization_config(opts)
    _save(model_dir, out_dir, out, {**config, "quantization_config": qconfig})
    return qconfig


def _scale_dtype(weight: torch.Tensor) -> torch.dtype:
    return weight.dtype if weight.dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.float32


def _quantize(weight: torch.Tensor, opts: QuantizeOptions, hessian: torch.Tensor | None) -> dict[str, torch.Tensor]:
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    w = weight.float()
    sdt = _scale_dtype(weight)
    if opts.method == "int4":
        def params(cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            scale = (cols.abs().amax(dim=1) / 7.5).clamp(min=1e-8).to(sdt).float()
            return scale, torch.full_like(scale, 8.0)
        group = opts.group_size
        if hessian is not None:
            q, scale, _ = gptq_quantize(w, hessian, params, group, 0, 15)
        else:
            q, scale = _rtn(w, params, group, 0, 15)
        signed = (q - 8).to(torch.int8)
        return {"weight_packed": pack_to_int32(signed, 4), "weight_scale": scale.to(sdt),
                "weight_shape": torch.tensor(list(w.shape), dtype=torch.int64)}
    row_scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-8).to(sdt).float()

    def channel(cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return row_scale, torch.zeros_like(row_scale)
    k = w.shape[1]
    if hessian is not None:
        q, _, _ = gptq_quantize(w, hessian, channel, k, -128, 127)
    else:
        q, _ = _rtn(w, channel, k, -128, 127)
    return {"weight": q.to(torch.int8), "weight_scale": row_scale.to(sdt)[:, None]}


def _rtn(w: torch.Tensor, params: Any, group: int, qmin: int, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    qs, scales = [], []
    for c in range(0, w.shape[1], group):
        cols = w[:, c:c + group]
        scale, zero = params(cols)
        qs.append(torch.clamp(torch.round(cols / scale[:, None]) + zero[:, None], qmin, qmax))
        scales.append(scale)
    return torch.cat(qs, dim=1), torch.stack(scales, dim=1)


def _quantization_config(opts: QuantizeOptions) -> dict[str, Any]:
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    if opts.method == "int4":
        weights = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group",
                                   group_size=opts.group_size)
    else:
        weights = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")
    acts = (QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)
            if opts.method == "w8a8" else None)
    scheme = QuantizationScheme(targets=["Linear"], weights=weights, input_activations=acts)
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"],
                                format="pack-quantized" if opts.method == "int4" else "int-quantized",
                                quantization_status="compressed")
    out: dict[str, Any] = json.loads(config.model_dump_json())
    return out


def _calibrate(model_dir: str, opts: QuantizeOptions) -> dict[str, HessianAccumulator]:
    """Each quantized projection's input statistics over the calibration text, from the float model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert opts.calibration is not None
    try:
        with open(opts.calibration, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"cannot read the calibration text: {e}") from None
    ids = AutoTokenizer.from_pretrained(model_dir)(text)["input_ids"][:opts.calibration_tokens]
    if len(ids) < 2:
        raise ValueError(f"the calibration text {opts.calibration!r} is too short (under 2 tokens)")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    stats: dict[str, HessianAccumulator] = {}
    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.split(".")[-1] in QUANTIZED:
            acc = stats[name] = HessianAccumulator(module.in_features)
            hooks.append(module.register_forward_pre_hook(lambda _m, args, acc=acc: acc.add(args[0])))
    with torch.no_grad():
        for start in range(0, len(ids), opts.window):
            model(input_ids=torch.tensor([ids[start:start + opts.window]]))
    for hook in hooks:
        hook.remove()
    return stats


def _smooth(tensors: dict[str, torch.Tensor], stats: dict[str, HessianAccumulator]) -> None:
    """SmoothQuant's migration, in place: norm weight / s, the projections' input columns * s."""
    for norm_name in [n for n in tensors if n.split(".")[-2] in SMOOTHED and n.endswith(".weight")]:
        layer = norm_name.rsplit(".", 2)[0]
        projections = [f"{layer}.{p}" for p in SMOOTHED[norm_name.split(".")[-2]]]
        if not all(f"{p}.weight" in tensors and p in stats for p in projections):
            continue
        x_max = torch.stack([stats[p].absmax for p in projections]).amax(dim=0)
        w_max = torch.cat([tensors[f"{p}.weight"].float() for p in projections]).abs().amax(dim=0)
        s = (x_max.clamp(min=1e-5) ** SMOOTH_ALPHA / w_max.clamp(min=1e-5) ** (1 - SMOOTH_ALPHA)).clamp(min=1e-5)
        norm = tensors[norm_name]
        tensors[norm_name] = (norm.float() / s).to(norm.dtype)
        for p in projections:
            w = tensors[f"{p}.weight"]
            tensors[f"{p}.weight"] = (w.float() * s[None, :]).to(w.dtype)


def _save(model_dir: str, out_dir: str, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    for name in os.listdir(model_dir):
        if name.startswith(("tokenizer", "special_tokens", "generation_config", "vocab", "merges")):
            shutil.copy(os.path.join(model_dir, name), out_dir)
