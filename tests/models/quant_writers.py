"""Writers of quantized test checkpoints, independent of tokenmill's loaders: each takes a float
checkpoint and writes (1) the quantized checkpoint in its format and (2) a float checkpoint of the same
weights dequantized by the writer itself, the reference the quantized model must match.

- compressed-tensors: the `compressed-tensors` library does it all (its calculate_qparams, its
  compressors' compress and decompress, its QuantizationConfig for config.json).
- GPTQ: written here from the format's published description (AutoGPTQ's `QuantLinear.pack`, the
  layout vLLM and transformers read): qweight int32 [K / 8, N] with input row k in bits 4 (k % 8) of
  word row k // 8; qzeros int32 [G, N / 8] with output n in bits 4 (n % 8) of column n // 8, each
  stored as zero - 1 (the original "gptq" checkpoint format); scales fp16 [G, N]; g_idx int32 [K], the
  group of each input column: with act-order (desc_act) the columns are taken in decreasing order of a
  Hessian diagonal and grouped in that order, so g_idx is a permutation's groups. Layers reading the
  same input (q/k/v, gate/up) share that order, as GPTQ's Hessians of one input do.
- AWQ (GEMM version): from AutoAWQ's `WQLinear_GEMM.from_linear` description: qweight int32 [K, N / 8],
  nibble i of column c holding output c * 8 + [0, 2, 4, 6, 1, 3, 5, 7][i]; qzeros int32 [G, N / 8] packed
  the same way (zeros as they are); scales fp16 [G, N]; asymmetric, zero = -round(min / scale).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable

import numpy as np
import torch
from safetensors.torch import load_file, save_file

QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
Quantizer = Callable[[str, torch.Tensor], tuple[dict[str, torch.Tensor], torch.Tensor]]


def _write(src: str, out: str, ref_out: str, quantize: Quantizer, quantization_config: dict[str, object]) -> None:
    """quantize(name, weight) -> (the module's tensors by suffix, the dequantized weight)."""
    tensors = load_file(os.path.join(src, "model.safetensors"))
    quant: dict[str, torch.Tensor] = {}
    ref: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith(".weight") and name.split(".")[-2] in QUANTIZED:
            prefix = name.removesuffix("weight")
            parts, deq = quantize(name, t.float())
            quant.update({prefix + k: v.contiguous() for k, v in parts.items()})
            ref[name] = deq.float()
        else:
            quant[name] = ref[name] = t
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    for d, data, cfg in ((out, quant, {**config, "quantization_config": quantization_config}), (ref_out, ref, config)):
        os.makedirs(d, exist_ok=True)
        save_file(data, os.path.join(d, "model.safetensors"))
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(cfg, f)
        for extra in os.listdir(src):
            if extra.startswith("tokenizer") or extra == "special_tokens_map.json":
                shutil.copy(os.path.join(src, extra), d)


# ---- compressed-tensors, by the library ----------------------------------------------------------------

def write_compressed_tensors(src: str, out: str, ref_out: str, scheme: str, group: int | None = None,
                             symmetric: bool = True) -> None:
    """scheme: int8 (W8A16), w8a8, int4 (pack-quantized, group-wise or per channel)."""
    from compressed_tensors.compressors.naive_quantized.base import IntQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    bits = 4 if scheme == "int4" else 8
    weights = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric,
                               strategy="group" if group else "channel", group_size=group)
    acts = (QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)
            if scheme == "w8a8" else None)
    qscheme = QuantizationScheme(targets=["Linear"], weights=weights, input_activations=acts)
    compressor = PackedQuantizationCompressor if bits == 4 else IntQuantizationCompressor

    def quantize(name: str, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        view = w.view(w.shape[0], -1, group) if group else w.view(w.shape[0], 1, -1)
        scale, zp = calculate_qparams(view.amin(-1), view.amax(-1), weights)
        state = {"weight": w, "weight_scale": scale, "weight_zero_point": zp}
        compressed = compressor.compress(state, qscheme)
        return compressed, compressor.decompress(compressed, qscheme)["weight"]

    fmt = "pack-quantized" if bits == 4 else "int-quantized"
    config = QuantizationConfig(config_groups={"group_0": qscheme}, format=fmt, ignore=["lm_head"],
                                quantization_status="compressed")
    _write(src, out, ref_out, quantize, json.loads(config.model_dump_json()))


# ---- GPTQ and AWQ, from their layouts ---------------------------------------------------------------

def _int32(words: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(words.astype(np.uint32).view(np.int32).copy())


def _asym_params(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of w [N, n]: scale and zero for 0..15 (AutoAWQ's / GPTQ's min-max rule)."""
    lo, hi = w.amin(dim=1).clamp(max=0), w.amax(dim=1).clamp(min=0)
    scale = ((hi - lo) / 15).clamp(min=1e-5).half().float()
    return scale, (-torch.round(lo / scale)).clamp(0, 15)


def _sym_params(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (w.abs().amax(dim=1) * 2 / 15).clamp(min=1e-5).half().float()
    return scale, torch.full_like(scale, 8.0)


def write_gptq(src: str, out: str, ref_out: str, group: int, act_order: bool, symmetric: bool = True) -> None:
    def column_order(name: str, k: int) -> torch.Tensor:
        # one "Hessian diagonal" per input: q/k/v share theirs, gate/up theirs
        shared = name.replace("k_proj", "q_proj").replace("v_proj", "q_proj").replace("up_proj", "gate_proj")
        gen = torch.Generator().manual_seed(sum(map(ord, shared)))
        return torch.argsort(torch.rand(k, generator=gen), descending=True)

    def quantize(name: str, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        n, k = w.shape
        order = column_order(name, k) if act_order else torch.arange(k)
        g_idx = torch.empty(k, dtype=torch.int64)
        g_idx[order] = torch.arange(k) // group
        num_g = -(-k // group)
        scales, zeros = torch.empty(num_g, n), torch.empty(num_g, n)
        for g in range(num_g):
            cols = (g_idx == g).nonzero()[:, 0]
            scales[g], zeros[g] = (_sym_params if symmetric else _asym_params)(w[:, cols])
        s, z = scales[g_idx].T, zeros[g_idx].T  # [N, K]
        q = (torch.round(w / s) + z).clamp(0, 15).to(torch.int64)
        intweight = q.T.numpy()  # [K, N]
        qweight = np.zeros((k // 8, n), dtype=np.uint64)
        for j in range(8):
            qweight |= intweight[j::8].astype(np.uint64) << (4 * j)
        stored = ((zeros.to(torch.int64) - 1) & 0xF).numpy()  # zero - 1, in 4 bits
        qzeros = np.zeros((num_g, n // 8), dtype=np.uint64)
        for j in range(8):
            qzeros |= stored[:, j::8].astype(np.uint64) << (4 * j)
        parts = {"qweight": _int32(qweight), "qzeros": _int32(qzeros), "scales": scales.half(),
                 "g_idx": g_idx.to(torch.int32)}
        return parts, (q.float() - z) * s

    config = {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": act_order, "sym": symmetric,
              "checkpoint_format": "gptq"}
    _write(src, out, ref_out, quantize, config)


def write_awq(src: str, out: str, ref_out: str, group: int) -> None:
    def pack(values: np.ndarray) -> torch.Tensor:  # [R, N] in 0..15 -> [R, N / 8]
        words = np.zeros((values.shape[0], values.shape[1] // 8), dtype=np.uint64)
        for col in range(words.shape[1]):
            for i in range(8):
                words[:, col] |= values[:, col * 8 + AWQ_ORDER[i]].astype(np.uint64) << (4 * i)
        return _int32(words)

    def quantize(name: str, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        n, k = w.shape
        groups = w.view(n, k // group, group)
        scales, zeros = _asym_params(groups.permute(1, 0, 2).reshape(-1, group))
        scales, zeros = scales.view(k // group, n), zeros.view(k // group, n)
        s, z = scales.repeat_interleave(group, 0).T, zeros.repeat_interleave(group, 0).T
        q = (torch.round(w / s) + z).clamp(0, 15).to(torch.int64)
        parts = {"qweight": pack(q.T.numpy()), "qzeros": pack(zeros.to(torch.int64).numpy()),
                 "scales": scales.half()}
        return parts, (q.float() - z) * s

    config = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    _write(src, out, ref_out, quantize, config)
