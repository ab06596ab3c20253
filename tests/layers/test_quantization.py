"""Quantized checkpoints that do not fit fail at load with one message naming the tensor (or the
config.json key); quantization_config is detected and --quantization overrides it; the fused decode path
declines quantized models, which then decode by the layer path."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.models import quant_writers as qw
from tokenmill import LLM, SamplingParams
from tokenmill.arch import load_arch_config
from tokenmill.config import EngineArgs
from tokenmill.kernels import load_cpu_kernels
from tokenmill.layers.quantization import AMX_MAX_ROWS, QuantizedLinearMethod, quantized_kernels
from tokenmill.layers.quantization import reference as ref
from tokenmill.models.loader import load_model
from tokenmill.quantization_config import QuantConfig, resolve_quantization


def _load(model_dir: str, quantization: str | None = None) -> Any:
    cfg = resolve_quantization(model_dir, quantization)
    assert cfg is not None
    return load_model(model_dir, load_arch_config(model_dir), torch.float32, torch.device("cpu"),
                      QuantizedLinearMethod(cfg))


def _edit_config(model_dir: str, **changes: Any) -> None:
    path = os.path.join(model_dir, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["quantization_config"].update(changes)
    with open(path, "w") as f:
        json.dump(config, f)


def _drop(model_dir: str, name: str) -> None:
    path = os.path.join(model_dir, "model.safetensors")
    tensors = load_file(path)
    del tensors[name]
    save_file(tensors, path)


def test_detection_and_override(model_dirs: dict[str, str], tmp_path: os.PathLike[str]) -> None:
    src = model_dirs["llama-gqa4-untied"]
    gptq = os.path.join(tmp_path, "gptq")
    qw.write_gptq(src, gptq, os.path.join(tmp_path, "ref"), 32, act_order=True)
    assert resolve_quantization(gptq, None) == QuantConfig("gptq", "int4", 32, act_order=True, gptq_zero_offset=1)
    assert resolve_quantization(gptq, "gptq") == resolve_quantization(gptq, None)
    assert resolve_quantization(src, None) is None
    # the rounding methods int8 and int4 round the lm_head too; W8A8 and the checkpoint formats leave it float
    assert resolve_quantization(src, "int4") == QuantConfig("rtn", "int4", 128, lm_head=True)
    assert resolve_quantization(src, "int8") == QuantConfig("rtn", "int8", lm_head=True)
    assert resolve_quantization(src, "w8a8") == QuantConfig("rtn", "w8a8")
    with pytest.raises(ValueError, match="quant_method 'gptq'"):
        resolve_quantization(gptq, "awq")
    with pytest.raises(ValueError, match="already quantized"):
        resolve_quantization(gptq, "int8")
    with pytest.raises(ValueError, match="unknown"):
        EngineArgs(src, quantization="int3").create_engine_config()
    assert EngineArgs(gptq).create_engine_config().model.quantization == resolve_quantization(gptq, None)


def test_a_missing_scale_is_named(model_dirs: dict[str, str], tmp_path: os.PathLike[str]) -> None:
    out = os.path.join(tmp_path, "ct")
    qw.write_compressed_tensors(model_dirs["llama-gqa4-untied"], out, os.path.join(tmp_path, "ref"), "int4", 32)
    _drop(out, "model.layers.1.self_attn.k_proj.weight_scale")
    with pytest.raises(ValueError, match=r"layers\.1\.self_attn\.qkv_proj\.weight_scale\[k\]"):
        _load(out)


def test_a_wrong_group_size_is_named(model_dirs: dict[str, str], tmp_path: os.PathLike[str]) -> None:
    out = os.path.join(tmp_path, "gptq")
    qw.write_gptq(model_dirs["llama-gqa4-untied"], out, os.path.join(tmp_path, "ref"), 32, act_order=False)
    _edit_config(out, group_size=64)
    named = r"tensor 'model\.layers\.0\.mlp\.down_proj\.qzeros'.*\[4, 8\].*\[2, 8\].*group size 64"
    with pytest.raises(ValueError, match=named):
        _load(out)
    _edit_config(out, group_size=48)
    with pytest.raises(ValueError, match="group_size 48 is not supported"):
        resolve_quantization(out, None)


def test_act_order_groups_that_do_not_fit_the_group_size_are_named(model_dirs: dict[str, str],
                                                                   tmp_path: os.PathLike[str]) -> None:
    out = os.path.join(tmp_path, "gptq")
    qw.write_gptq(model_dirs["llama-gqa4-untied"], out, os.path.join(tmp_path, "ref"), 32, act_order=True)
    path = os.path.join(out, "model.safetensors")
    tensors = load_file(path)
    tensors["model.layers.0.mlp.down_proj.g_idx"] = torch.zeros_like(tensors["model.layers.0.mlp.down_proj.g_idx"])
    save_file(tensors, path)
    with pytest.raises(ValueError, match=r"layer layers\.0\.mlp\.down_proj: g_idx does not assign 32"):
        _load(out)


def test_unknown_bits_and_unsupported_schemes_are_named(model_dirs: dict[str, str], tmp_path: os.PathLike[str]) -> None:
    out = os.path.join(tmp_path, "awq")
    qw.write_awq(model_dirs["llama-gqa4-untied"], out, os.path.join(tmp_path, "ref"), 32)
    _edit_config(out, bits=3)
    with pytest.raises(ValueError, match=r"awq quantization_config\.bits 3 is not supported"):
        resolve_quantization(out, None)
    _edit_config(out, bits=4, version="gemv")
    with pytest.raises(ValueError, match="version 'gemv' is not supported"):
        resolve_quantization(out, None)
    ct = os.path.join(tmp_path, "ct")
    qw.write_compressed_tensors(model_dirs["llama-gqa4-untied"], ct, os.path.join(tmp_path, "ref2"), "int8")
    with open(os.path.join(ct, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["type"] = "float"
    with open(os.path.join(ct, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match="type 'float' is not supported"):
        resolve_quantization(ct, None)


def test_a_float_tensor_where_int8_is_stored_is_named(model_dirs: dict[str, str], tmp_path: os.PathLike[str]) -> None:
    out = os.path.join(tmp_path, "ct")
    qw.write_compressed_tensors(model_dirs["llama-gqa4-untied"], out, os.path.join(tmp_path, "ref"), "int8")
    path = os.path.join(out, "model.safetensors")
    tensors = load_file(path)
    tensors["model.layers.0.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"].float()
    save_file(tensors, path)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj\.weight.*float32.*int8"):
        _load(out)


def test_the_fused_decode_path_takes_quantized_models_with_kernels(model_dirs: dict[str, str]) -> None:
    src = model_dirs["llama-gqa4-untied"]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for kernels in (True, False):
        llm = LLM(src, dtype="bfloat16", kv_cache_memory="8MiB", quantization="int8", cpu_kernels=kernels)
        runner = llm.engine.core.executor.worker.runner()  # type: ignore[attr-defined]
        expected = kernels and quantized_kernels(load_cpu_kernels(), "int8") is not None
        assert (runner.fused_decode is not None) == expected
        out = llm.generate([[5, 6, 7]], params, use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4


def test_the_fused_decode_path_declines_act_order(model_dirs: dict[str, str], tmp_path: os.PathLike[str]) -> None:
    # GPTQ act-order permutes x's columns in Python before the kernel: the fused loop does not
    out = os.path.join(tmp_path, "gptq")
    qw.write_gptq(model_dirs["llama-gqa4-untied"], out, os.path.join(tmp_path, "ref"), 32, act_order=True)
    llm = LLM(out, dtype="bfloat16", kv_cache_memory="8MiB")
    assert llm.engine.core.executor.worker.runner().fused_decode is None  # type: ignore[attr-defined]


class _Calls:
    """The kernels, recording which ops are called."""

    def __init__(self, ops: Any) -> None:
        self.ops, self.called = ops, []  # type: ignore[var-annotated]

    def __getattr__(self, name: str) -> Any:
        op = getattr(self.ops, name)

        def call(*args: Any) -> Any:
            self.called.append(name)
            return op(*args)
        return call


def test_the_int8_lm_head_takes_a_long_batch_in_slices(model_dirs: dict[str, str]) -> None:
    # more rows than the AMX op takes (prompt logprobs, a very large batch): the int8 lm_head runs them through it
    # AMX_MAX_ROWS at a time, never through a whole dequantized copy of the vocabulary's weight
    ops = load_cpu_kernels()
    if ops is None or not ops.has_dequant_amx():
        pytest.skip("no AMX-BF16 here: batches over 16 rows multiply a dequantized weight")
    model_dir = model_dirs["llama-gqa4-untied"]
    cfg = resolve_quantization(model_dir, "int8")
    assert cfg is not None and cfg.lm_head
    model = load_model(model_dir, load_arch_config(model_dir), torch.bfloat16, torch.device("cpu"),
                       QuantizedLinearMethod(cfg, ops))
    head = model.lm_head
    method = head.method
    assert isinstance(method, QuantizedLinearMethod) and method.split_rows
    x = torch.randn(2 * AMX_MAX_ROWS + 37, head.input_size, generator=torch.Generator().manual_seed(0)).bfloat16()
    method.kernels = calls = _Calls(method.kernels)
    got = method.apply(head, x)
    assert [c for c in calls.called if c != "has_dequant_amx"] == ["int8_linear"] * 3
    w = method.dequantized_weight(head).bfloat16()
    expected = ref.linear_ref(x, w, None)
    bound = 2**-6 * float((x.float().abs() @ w.float().abs().T).max())
    assert got.shape == expected.shape and float((got.float() - expected.float()).abs().max()) <= bound


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_the_rounding_methods_quantize_each_layer_as_soon_as_it_is_loaded(model_dirs: dict[str, str], scheme: str,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """`--quantization int8|int4` rounds a layer's float weight when its last tensor is in, so a load never holds
    the whole float checkpoint beside its integers (`QuantizedLinearMethod.repacks`, the loader's staging)."""
    from tokenmill.models import loader

    model_dir = model_dirs["llama-gqa4-untied"]
    read: list[str] = []
    real_iterate = loader.iterate_checkpoint

    def counting(*args: Any, **kwargs: Any) -> Any:
        for name, t in real_iterate(*args, **kwargs):
            read.append(name)
            yield name, t

    at_process: list[int] = []
    real_process = QuantizedLinearMethod.process_weights_after_loading

    def recording(self: QuantizedLinearMethod, layer: Any) -> None:
        at_process.append(len(read))
        real_process(self, layer)

    monkeypatch.setattr(loader, "iterate_checkpoint", counting)
    monkeypatch.setattr(QuantizedLinearMethod, "process_weights_after_loading", recording)
    cfg = resolve_quantization(model_dir, scheme)
    assert cfg is not None
    model = load_model(model_dir, load_arch_config(model_dir), torch.float32, torch.device("cpu"),
                       QuantizedLinearMethod(cfg, None))
    assert at_process and min(at_process) < len(read)  # the first layer before the checkpoint was read through
    rounded = [m for m in model.modules() if isinstance(m.__dict__.get("method"), QuantizedLinearMethod)]
    assert rounded and all(m.__dict__["processed"] and not hasattr(m, "weight") for m in rounded)


@pytest.mark.parametrize("scheme", ["int8", "int4", "w8a8"])
def test_rounding_in_the_kernels_op_holds_the_references_integers(model_dirs: dict[str, str], scheme: str) -> None:
    """A rounding load through the C++ op (rtn_int8 / rtn_int4: one pass a row) leaves every layer the same
    tensors as the torch reference's rounding does."""
    ops = load_cpu_kernels()
    if ops is None:
        pytest.skip("tokenmill's CPU kernels are not built here")
    model_dir = model_dirs["llama-gqa4-untied"]
    cfg = resolve_quantization(model_dir, scheme)
    assert cfg is not None
    arch = load_arch_config(model_dir)
    models = [load_model(model_dir, arch, torch.bfloat16, torch.device("cpu"), QuantizedLinearMethod(cfg, k))
              for k in (ops, None)]
    layers = [{n: m for n, m in model.named_modules() if isinstance(m.__dict__.get("method"), QuantizedLinearMethod)}
              for model in models]
    assert layers[0] and layers[0].keys() == layers[1].keys()
    for name, layer in layers[0].items():
        other = layers[1][name]
        for param in ("qweight", "scales", "zeros", "weight_sum"):
            if hasattr(other, param):
                assert torch.equal(getattr(layer, param), getattr(other, param)), f"{name}.{param}"
