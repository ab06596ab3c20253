"""Golden tests of quantized models: greedy output token-identical to the same model with its weights
dequantized (by the checkpoint's independent writer, tests/models/quant_writers.py) and run as a float
model, for each format and scheme; W8A8, whose activations are quantized too, against its own torch
reference path (--no-cpu-kernels). float32, so the kernels' fp32 sums differ from the float model's only
in order. Decode steps run the C++ kernels, prompts over 16 tokens the reference path."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch

from tests.conftest import random_prompts
from tests.models import quant_writers as qw
from tokenmill import LLM, SamplingParams
from tokenmill.arch import load_arch_config
from tokenmill.kernels import load_cpu_kernels
from tokenmill.layers.quantization import QuantizedLinearMethod
from tokenmill.models.loader import load_model
from tokenmill.quantization_config import resolve_quantization

PROMPTS = random_prompts(3, 3, 30, seed=7)
MAX_TOKENS = 12


def _greedy(model_dir: str, **kwargs: object) -> list[list[int]]:
    llm = LLM(model_dir, dtype="float32", kv_cache_memory="8MiB", **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


WRITERS: dict[str, tuple[str, Callable[[str, str, str], None]]] = {
    "ct-int8": ("qwen2-mha", lambda s, o, r: qw.write_compressed_tensors(s, o, r, "int8")),
    "ct-int4-g32-sym": ("llama-gqa4-untied", lambda s, o, r: qw.write_compressed_tensors(s, o, r, "int4", 32)),
    "ct-int4-g64-asym": ("qwen2-mha", lambda s, o, r: qw.write_compressed_tensors(s, o, r, "int4", 64, False)),
    "ct-int4-channel": ("llama-gqa2-tied", lambda s, o, r: qw.write_compressed_tensors(s, o, r, "int4")),
    "gptq-g32": ("llama-gqa4-untied", lambda s, o, r: qw.write_gptq(s, o, r, 32, act_order=False)),
    "gptq-g32-act-order-asym": ("qwen2-mha", lambda s, o, r: qw.write_gptq(s, o, r, 32, True, symmetric=False)),
    "gptq-g64-act-order": ("llama-gqa2-tied", lambda s, o, r: qw.write_gptq(s, o, r, 64, act_order=True)),
    "awq-g32": ("llama-gqa4-untied", lambda s, o, r: qw.write_awq(s, o, r, 32)),
    "awq-g64": ("qwen2-mha", lambda s, o, r: qw.write_awq(s, o, r, 64)),
}


@pytest.mark.parametrize("case", list(WRITERS))
def test_quantized_checkpoint_matches_its_dequantized_model(model_dirs: dict[str, str], tmp_path: os.PathLike[str],
                                                            case: str) -> None:
    name, write = WRITERS[case]
    quant_dir, ref_dir = os.path.join(tmp_path, "quant"), os.path.join(tmp_path, "ref")
    write(model_dirs[name], quant_dir, ref_dir)
    quant = resolve_quantization(quant_dir, None)
    assert quant is not None and quant.format == case.split("-")[0].replace("ct", "compressed-tensors")
    model = load_model(quant_dir, load_arch_config(quant_dir), torch.float32, torch.device("cpu"),
                       QuantizedLinearMethod(quant, load_cpu_kernels()))
    layer = model.layers[0].mlp.down_proj
    assert layer.qweight.dtype in (torch.int8, torch.uint8) and not hasattr(layer, "weight")  # no float copy
    assert _greedy(quant_dir) == _greedy(ref_dir)


def test_w8a8_kernels_match_the_reference_path(model_dirs: dict[str, str], tmp_path: os.PathLike[str]) -> None:
    quant_dir = os.path.join(tmp_path, "w8a8")
    qw.write_compressed_tensors(model_dirs["qwen2-mha"], quant_dir, os.path.join(tmp_path, "ref"), "w8a8")
    assert _greedy(quant_dir) == _greedy(quant_dir, cpu_kernels=False)


@pytest.mark.parametrize("method", ["int8", "int4", "w8a8"])
def test_quantize_at_load_kernels_match_the_reference_path(model_dirs: dict[str, str], method: str) -> None:
    src = model_dirs["llama-gqa4-untied"]
    assert _greedy(src, quantization=method) == _greedy(src, quantization=method, cpu_kernels=False)
