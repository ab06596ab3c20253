"""`tokenmill quantize` writes compressed-tensors checkpoints: the library's own decompressor reads them
back to weights close to the float ones, tokenmill loads them (detected from config.json) with the same
greedy tokens as the weights the library decompresses run as a float model, and calibration (GPTQ,
SmoothQuant) moves a layer's outputs on the calibration inputs less than round-to-nearest does."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import random_prompts
from tokenmill import LLM, SamplingParams
from tokenmill.entrypoints.cli import main
from tokenmill.layers.quantization.gptq import HessianAccumulator, gptq_quantize

PROMPTS = random_prompts(3, 3, 30, seed=11)
CALIBRATION = "def main():\n    return sorted(os.listdir('.'), key=len)\n" * 40


def _greedy(model_dir: str) -> list[list[int]]:
    llm = LLM(model_dir, dtype="float32", kv_cache_memory="8MiB")
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def _decompressed(quant_dir: str, out: str) -> None:
    """The float checkpoint the compressed-tensors library decompresses quant_dir into."""
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    with open(os.path.join(quant_dir, "config.json")) as f:
        config = json.load(f)
    qconfig = QuantizationConfig.model_validate(config.pop("quantization_config"))
    scheme = qconfig.config_groups["group_0"]
    compressor = BaseCompressor.load_from_registry(qconfig.format)
    tensors = load_file(os.path.join(quant_dir, "model.safetensors"))
    modules = {n.rsplit(".", 1)[0] for n in tensors if n.endswith("weight_scale")}
    for m in modules:
        state = {k.rsplit(".", 1)[1]: tensors.pop(k) for k in list(tensors) if k.rsplit(".", 1)[0] == m}
        tensors[f"{m}.weight"] = compressor.decompress(state, scheme)["weight"].float()
    os.makedirs(out)
    save_file(tensors, os.path.join(out, "model.safetensors"))
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    for name in os.listdir(quant_dir):
        if name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(os.path.join(quant_dir, name), out)


@pytest.mark.parametrize("method,extra", [("int8", []), ("int4", ["--group-size", "64", "--calibration", "CAL"])])
def test_quantize_writes_what_the_library_and_tokenmill_read(model_dirs: dict[str, str], tmp_path: os.PathLike[str],
                                                             method: str, extra: list[str]) -> None:
    src = model_dirs["llama-gqa4-untied"]
    cal = os.path.join(tmp_path, "cal.txt")
    with open(cal, "w") as f:
        f.write(CALIBRATION)
    out, ref = os.path.join(tmp_path, "q"), os.path.join(tmp_path, "ref")
    assert main(["quantize", src, "--method", method, "--out", out, *[cal if a == "CAL" else a for a in extra]]) == 0
    _decompressed(out, ref)
    float_w = load_file(os.path.join(src, "model.safetensors"))["model.layers.0.mlp.down_proj.weight"].float()
    deq = load_file(os.path.join(ref, "model.safetensors"))["model.layers.0.mlp.down_proj.weight"]
    assert float((deq - float_w).norm() / float_w.norm()) < (0.01 if method == "int8" else 0.25)
    assert _greedy(out) == _greedy(ref)


def test_w8a8_with_smoothquant_loads_and_runs(model_dirs: dict[str, str], tmp_path: os.PathLike[str]) -> None:
    src = model_dirs["llama-gqa4-untied"]
    cal = os.path.join(tmp_path, "cal.txt")
    with open(cal, "w") as f:
        f.write(CALIBRATION)
    out = os.path.join(tmp_path, "q")
    assert main(["quantize", src, "--method", "w8a8", "--calibration", cal, "--out", out]) == 0
    norm = "model.layers.0.input_layernorm.weight"
    smoothed = load_file(os.path.join(out, "model.safetensors"))[norm]
    assert not torch.equal(smoothed, load_file(os.path.join(src, "model.safetensors"))[norm])
    with open(os.path.join(out, "config.json")) as f:
        acts = json.load(f)["quantization_config"]["config_groups"]["group_0"]["input_activations"]
    assert acts["strategy"] == "token" and acts["dynamic"]
    assert len(_greedy(out)[0]) == 10


def test_gptq_beats_round_to_nearest_on_its_calibration_inputs() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(512, 128, generator=gen) * torch.linspace(0.1, 3, 128)  # uneven input columns
    x = x @ (torch.eye(128) + 0.3 * torch.randn(128, 128, generator=gen))  # correlated, as activations are
    w = torch.randn(64, 128, generator=gen)
    acc = HessianAccumulator(128)
    acc.add(x)

    def params(cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scale = cols.abs().amax(dim=1) / 7.5
        return scale, torch.full_like(scale, 8.0)

    q, scale, zero = gptq_quantize(w, acc.hessian(), params, 32, 0, 15)
    deq = (q - zero.repeat_interleave(32, 1)) * scale.repeat_interleave(32, 1)
    groups = w.view(64, 4, 32)
    rtn_scale = groups.abs().amax(dim=2, keepdim=True) / 7.5
    rtn = ((torch.round(groups / rtn_scale) + 8).clamp(0, 15) - 8) * rtn_scale
    err_gptq = (x @ (deq - w).T).norm()
    err_rtn = (x @ (rtn.view(64, 128) - w).T).norm()
    assert err_gptq < 0.8 * err_rtn


def test_quantize_refuses_bad_input(model_dirs: dict[str, str], tmp_path: os.PathLike[str],
                                    capsys: pytest.CaptureFixture[str]) -> None:
    src = model_dirs["llama-gqa4-untied"]
    assert main(["quantize", src, "--method", "int4", "--group-size", "48", "--out", str(tmp_path)]) == 2
    assert "group size 48" in capsys.readouterr().err
    assert main(["quantize", src, "--method", "int8", "--calibration", "/nonexistent", "--out", str(tmp_path)]) == 2
    assert "calibration" in capsys.readouterr().err


def test_the_cli_offers_the_methods_quantize_has() -> None:
    # the parser lists them itself (quantize imports torch, and every command builds the parser)
    from tokenmill.entrypoints.cli import build_parser
    from tokenmill.entrypoints.quantize import METHODS

    sub = next(a for a in build_parser()._actions if a.choices and "quantize" in a.choices)
    method = next(a for a in sub.choices["quantize"]._actions if a.dest == "method")
    assert tuple(method.choices) == METHODS
