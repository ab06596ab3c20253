"""The LinearMethod seam, end to end: a method whose parameters are not the float weight (int8 weights
with per-output-channel scales, as weight-only quantized checkpoints store them) is created by the
layers, filled by the model's own load_weights from tensors of other dtypes and shapes (fused q/k/v
and gate/up shards included), and runs; its logits equal the float model whose weights are the same
values dequantized. A checkpoint missing a scale fails naming it."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from tests.conftest import random_prompts
from tokenmill.arch import load_arch_config
from tokenmill.attention import get_backend
from tokenmill.attention.backend import AttentionMetadata
from tokenmill.kv_cache_spec import plan_kv_cache
from tokenmill.layers.linear import LinearBase
from tokenmill.models.interface import CausalLM
from tokenmill.models.loader import load_model
from tokenmill.worker.kv_cache import allocate_kv_caches, bind_kv_caches, kv_cache_specs

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")


class Int8WeightOnly:
    """W8A16 as a test method: int8 weight [out, in] and a float scale per output row."""

    def create_weights(self, layer: LinearBase, dtype: torch.dtype) -> None:
        layer.weight = nn.Parameter(torch.empty(layer.output_size, layer.input_size, dtype=torch.int8),
                                    requires_grad=False)
        layer.weight_scale = nn.Parameter(torch.empty(layer.output_size, dtype=torch.float32), requires_grad=False)
        for p in (layer.weight, layer.weight_scale):
            p.weight_loader = layer.weight_loader  # type: ignore[attr-defined]
        if layer.has_bias:
            layer.bias = nn.Parameter(torch.empty(layer.output_size, dtype=dtype), requires_grad=False)
            layer.bias.weight_loader = layer.weight_loader  # type: ignore[attr-defined]

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        return None

    def repacks(self, layer: LinearBase) -> bool:
        return False

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        w = layer.weight.float() * layer.weight_scale[:, None]
        return F.linear(x, w.to(x.dtype), layer.bias)


def _write_checkpoints(src: str, quant_dir: str, ref_dir: str, drop: str | None = None) -> None:
    tensors = load_file(os.path.join(src, "model.safetensors"))
    quant, ref = {}, {}
    for name, t in tensors.items():
        if name.endswith(".weight") and name.split(".")[-2] in PROJECTIONS:
            scale = t.float().abs().amax(dim=1).clamp(min=1e-8) / 127
            q = torch.round(t.float() / scale[:, None]).clamp(-127, 127).to(torch.int8)
            quant[name], quant[name.removesuffix("weight") + "weight_scale"] = q, scale
            ref[name] = (q.float() * scale[:, None]).to(t.dtype)
        else:
            quant[name] = ref[name] = t
    if drop is not None:
        del quant[drop]
    for out, data in ((quant_dir, quant), (ref_dir, ref)):
        os.makedirs(out, exist_ok=True)
        save_file(data, os.path.join(out, "model.safetensors"))
        shutil.copy(os.path.join(src, "config.json"), out)


def _logits(model: nn.Module, prompt: list[int]) -> torch.Tensor:
    cfg = plan_kv_cache(kv_cache_specs(model, 8, "float32"), 1 << 20)
    bind_kv_caches(model, allocate_kv_caches(cfg, torch.device("cpu")), get_backend("torch_ref"))
    n = len(prompt)
    meta = AttentionMetadata(slot_mapping=torch.arange(n), query_start_loc=[0, n], seq_lens=[n],
                             block_tables=[list(range(-(-n // 8)))], num_decodes=0, block_size=8)
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(prompt), torch.arange(n), meta))


def test_a_method_with_other_tensors_loads_and_matches_its_dequantized_model(
        model_dirs: dict[str, str], tmp_path: os.PathLike[str]) -> None:
    src = model_dirs["qwen2-mha"]  # qkv bias: the bias shards load beside the int8 weight's
    quant_dir, ref_dir = os.path.join(tmp_path, "int8"), os.path.join(tmp_path, "ref")
    _write_checkpoints(src, quant_dir, ref_dir)
    cfg = load_arch_config(src)
    quant = load_model(quant_dir, cfg, torch.float32, torch.device("cpu"), Int8WeightOnly())
    ref = load_model(ref_dir, cfg, torch.float32, torch.device("cpu"))
    assert isinstance(quant, CausalLM) and isinstance(ref, CausalLM)
    qkv = quant.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.int8 and qkv.weight_scale.shape == (qkv.output_size,)
    prompt = random_prompts(1, 20, 20, seed=5)[0]
    torch.testing.assert_close(_logits(quant, prompt), _logits(ref, prompt), rtol=0, atol=0)


def test_a_missing_scale_is_named(model_dirs: dict[str, str], tmp_path: os.PathLike[str]) -> None:
    src = model_dirs["llama-gqa4-untied"]
    dropped = "model.layers.1.self_attn.k_proj.weight_scale"
    quant_dir = os.path.join(tmp_path, "int8")
    _write_checkpoints(src, quant_dir, os.path.join(tmp_path, "ref"), drop=dropped)
    with open(os.path.join(quant_dir, "config.json")) as f:
        assert json.load(f)["num_hidden_layers"] >= 2
    with pytest.raises(ValueError, match=r"layers\.1\.self_attn\.qkv_proj\.weight_scale\[k\]"):
        load_model(quant_dir, load_arch_config(src), torch.float32, torch.device("cpu"), Int8WeightOnly())
