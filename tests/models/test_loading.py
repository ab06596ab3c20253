"""Checkpoint loading: sharded safetensors, both config.json dialects, dtype resolution."""

from __future__ import annotations

import json
import os
import shutil
import struct

import pytest
import torch

from tests.conftest import random_prompts
from tests.fixtures import build_model, hf_greedy, to_transformers4_dialect
from tokenmill import LLM, SamplingParams
from tokenmill.arch import load_arch_config, parse_arch_config
from tokenmill.config import EngineArgs, _resolve_dtype, default_block_size
from tokenmill.models.loader import checkpoint_files, iterate_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def test_sharded_checkpoint_matches_hf(tmp_path: os.PathLike[str], tokenizer_dir: str) -> None:
    model_dir = build_model("llama-gqa4-untied", os.path.join(tmp_path, "sharded"), tokenizer_dir,
                            max_shard_size="40KB")
    assert os.path.isfile(os.path.join(model_dir, "model.safetensors.index.json"))
    assert len(checkpoint_files(model_dir)) > 1
    prompt = random_prompts(1, 20, 20, seed=3)[0]
    out = LLM(model_dir, dtype="float32", kv_cache_memory="4MiB").generate([prompt], GREEDY, use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(model_dir, prompt, 12)


def test_both_config_dialects_parse_alike(model_dirs: dict[str, str]) -> None:
    with open(os.path.join(model_dirs["llama-gqa4-untied"], "config.json")) as f:
        v5 = json.load(f)
    assert "rope_parameters" in v5 and "dtype" in v5  # written by transformers 5
    a, b = parse_arch_config(v5), parse_arch_config(to_transformers4_dialect(v5, "rope_type"))
    assert a == b
    assert a.rope.rope_type == "llama3" and a.rope.factor == 8.0
    assert a.num_kv_heads == 1 and not a.tie_word_embeddings


def test_transformers4_dialect_checkpoint_generates_alike(model_dirs: dict[str, str],
                                                          tmp_path: os.PathLike[str]) -> None:
    src = model_dirs["llama-gqa4-untied"]
    dst = os.path.join(tmp_path, "v4")
    shutil.copytree(src, dst)
    with open(os.path.join(src, "config.json")) as f:
        cfg = to_transformers4_dialect(json.load(f), "rope_type")
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    prompt = random_prompts(1, 30, 30, seed=4)[0]
    got = [LLM(d, dtype="float32", kv_cache_memory="4MiB").generate([prompt], GREEDY, use_tqdm=False)[0]
           .outputs[0].token_ids for d in (src, dst)]
    assert got[0] == got[1] == hf_greedy(src, prompt, 12)


@pytest.mark.parametrize("flags", [frozenset({"avx2", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"}),
                                   frozenset({"avx2", "fma"}), frozenset({"avx2", "avx_ne_convert"}), frozenset()],
                         ids=["avx512-bf16", "avx2-only", "avx-ne-convert", "no-flags-line"])
def test_dtype_resolution(model_dirs: dict[str, str], monkeypatch: pytest.MonkeyPatch, flags: frozenset[str]) -> None:
    monkeypatch.setattr("tokenmill.cpu_features.cpu_flags", lambda: flags)
    runs_bf16 = flags != {"avx2", "fma"}  # oneDNN's bf16 matmul needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT
    arch = load_arch_config(model_dirs["qwen2-mha"])
    fp16 = parse_arch_config({**_raw(model_dirs["qwen2-mha"]), "dtype": "float16"})
    bf16 = parse_arch_config({**_raw(model_dirs["qwen2-mha"]), "dtype": "bfloat16"})
    assert _resolve_dtype("auto", arch, "cpu") == "float32"  # the fixture is saved in float32
    # fp16 matmul is ~300x slower than bf16 on CPUs; bf16 slower than float32 where oneDNN has no bf16 path
    assert _resolve_dtype("auto", fp16, "cpu") == ("bfloat16" if runs_bf16 else "float32")
    assert _resolve_dtype("auto", bf16, "cpu") == ("bfloat16" if runs_bf16 else "float32")
    assert _resolve_dtype("auto", fp16, "cuda") == "float16"
    assert _resolve_dtype("auto", bf16, "cuda") == "bfloat16"
    assert _resolve_dtype("float16", fp16, "cpu") == "float16"  # asked for explicitly
    assert _resolve_dtype("bfloat16", arch, "cpu") == "bfloat16"
    with pytest.raises(ValueError, match="dtype"):
        _resolve_dtype("int3", arch, "cpu")


def test_kv_pool_from_memory_budget(model_dirs: dict[str, str]) -> None:
    model_dir = model_dirs["llama-gqa2-tied"]
    cfg = EngineArgs(model=model_dir, dtype="float32", kv_cache_memory="1MiB").create_engine_config()
    arch = cfg.model.arch
    per_token = arch.kv_bytes_per_token * 4
    llm = LLM(model_dir, dtype="float32", kv_cache_memory="1MiB", max_model_len=256)
    assert cfg.cache.block_size == 32  # the CPU default
    assert llm.engine.core.num_blocks == 2**20 // (cfg.cache.block_size * per_token)
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(model_dir, dtype="float32", kv_cache_memory="64KiB")  # fewer tokens than max_model_len


def _raw(model_dir: str) -> dict:
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f)


def test_rotary_tables_follow_the_model_device(llama_dir: str) -> None:
    """The rope tables are computed on the CPU for start-up speed, once, as the model is built; they must
    still end on the model's device (a CUDA model once kept them on the CPU). The meta device stands in
    for CUDA."""
    import torch

    from tokenmill.models.loader import build_model

    model = build_model(load_arch_config(llama_dir), torch.float32, torch.device("meta"))
    assert model.rotary.cos_cache.device.type == "meta" and model.rotary.sin_cache.device.type == "meta"
    assert next(model.parameters()).device.type == "meta"


def test_block_size_defaults_by_device(model_dirs: dict[str, str]) -> None:
    """32 tokens a block on CPU (longer contiguous KV runs for the decode kernel), 16 on a GPU; a
    given size is kept, and a size below 1 is refused."""
    model_dir = model_dirs["llama-gqa2-tied"]
    assert EngineArgs(model=model_dir, device="cpu").create_engine_config().cache.block_size == 32
    assert EngineArgs(model=model_dir, block_size=16).create_engine_config().cache.block_size == 16
    assert default_block_size("cuda") == 16
    with pytest.raises(ValueError, match="block_size"):
        EngineArgs(model=model_dir, block_size=0).create_engine_config()


def test_mapped_checkpoint_gives_the_same_tensors(llama_dir: str, tmp_path: os.PathLike[str]) -> None:
    """Both readers of the mapped files, the one-rank load's (each tensor's pages dropped once the next is asked
    for: the tensors kept here are read after that) and a tensor-parallel rank's (views kept), give every tensor
    the safetensors library reads, also from a file whose header leaves the data unaligned for its dtype."""
    from safetensors.torch import load_file

    reference = {k: v for path in checkpoint_files(llama_dir) for k, v in load_file(path).items()}
    released = dict(iterate_checkpoint(llama_dir))
    kept = dict(iterate_checkpoint(llama_dir, keep_views=True))
    assert released.keys() == kept.keys() == reference.keys()
    assert all(torch.equal(released[k], reference[k]) and torch.equal(kept[k], reference[k]) for k in reference)
    t = torch.arange(6, dtype=torch.float32).view(2, 3)
    header = json.dumps({"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}}).encode() + b" "
    odd = os.path.join(tmp_path, "odd")
    os.makedirs(odd)
    with open(os.path.join(odd, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header + t.numpy().tobytes())
    assert (8 + len(header)) % 4  # the data starts off a float's alignment
    assert torch.equal(dict(iterate_checkpoint(odd, keep_views=True))["w"], t)
    assert torch.equal(dict(iterate_checkpoint(odd))["w"], t)
