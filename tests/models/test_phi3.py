"""Phi-3 against transformers, float32, on tiny random checkpoints built from its config
(tests/fixtures.py): fused qkv_proj / gate_up_proj checkpoint tensors, LongRoPE across its original
length, partial rotary with a sliding window; greedy tokens through chunked prefill with preemption
and through prefix-cache hits on every attention backend (single requests and mixed batches:
test_golden.py)."""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil

import pytest
import torch

from tests.conftest import random_prompts
from tests.fixtures import (
    _hf_model,
    check_chunked_prefill_and_preemption,
    greedy_ids,
    hf_expected,
)
from tokenmill import LLM
from tokenmill.arch import load_arch_config
from tokenmill.layers.rotary import RotaryEmbedding

BACKENDS = ["torch_ref", "sdpa", "cpu"]
PHIS = ["phi3-longrope", "phi3-partial-window"]
PROMPTS = random_prompts(5, 3, 45, seed=31)  # phi3-partial-window's window (24) is shorter than most
MAX_TOKENS = [14, 6, 10, 16, 9]
ORIGINAL = 128  # phi3-longrope's original_max_position_embeddings


@functools.cache
def cached_reference(model_dir: str, prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    """transformers' Phi-3, greedy, a prefill then one token a step over its KV cache: each position is
    rotated once, with the set its sequence length calls for. (`generate` instead drops the cache when
    the sequence first passes the original length and recomputes it all with the long set.)"""
    from transformers import DynamicCache

    model = _hf_model(model_dir)
    cache = DynamicCache(config=model.config)
    out: list[int] = []
    ids = torch.tensor([list(prompt)])
    with torch.no_grad():
        for _ in range(max_tokens):
            start = len(prompt) + len(out) - ids.shape[1]
            logits = model(ids, position_ids=torch.arange(start, start + ids.shape[1])[None], cache=cache,
                           use_cache=True).logits
            out.append(int(logits[0, -1].argmax()))
            ids = torch.tensor([[out[-1]]])
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", PHIS)
def test_chunked_prefill_and_preemption(model_dirs: dict[str, str], name: str, backend: str) -> None:
    check_chunked_prefill_and_preemption(model_dirs[name], backend, PROMPTS, MAX_TOKENS)


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefix_cache_hits(model_dirs: dict[str, str], backend: str) -> None:
    model_dir = model_dirs["phi3-partial-window"]
    shared = random_prompts(1, 40, 40, seed=32)[0]
    prompts = [shared + tail for tail in random_prompts(4, 1, 12, seed=33)]
    max_tokens = [10, 16, 5, 12]
    llm = LLM(model_dir, dtype="float32", kv_cache_memory="4MiB", attention_backend=backend, block_size=16)
    first = greedy_ids(llm, prompts[:1], max_tokens[:1])
    kv = llm.engine.core.scheduler.kv
    hits_before = kv.prefix_hits
    rest = greedy_ids(llm, prompts[1:], max_tokens[1:])
    assert kv.prefix_hits - hits_before >= 3 * 32
    assert first + rest == hf_expected(model_dir, prompts, max_tokens)


@pytest.mark.parametrize("backend", BACKENDS)
def test_longrope_across_the_original_length(model_dirs: dict[str, str], backend: str) -> None:
    """Prompts within the original length whose generation runs past it: positions from 128 on take the
    long factors. Batched, in chunks, the tokens are transformers' over its KV cache."""
    model_dir = model_dirs["phi3-longrope"]
    prompts = random_prompts(3, 112, 126, seed=34)
    max_tokens = [16, 12, 20]
    llm = LLM(model_dir, dtype="float32", kv_cache_memory="4MiB", attention_backend=backend,
              max_num_batched_tokens=48)
    got = greedy_ids(llm, prompts, max_tokens)
    assert got == [cached_reference(model_dir, tuple(p), n) for p, n in zip(prompts, max_tokens, strict=True)]


def test_longrope_tables(model_dirs: dict[str, str]) -> None:
    """cos/sin: the short set below the original length, the long set from it, both scaled by the
    attention factor sqrt(1 + ln(512 / 128) / ln(128)); factors of the wrong length are refused."""
    arch = load_arch_config(model_dirs["phi3-longrope"])
    rope = arch.rope
    assert rope.rope_type == "longrope" and rope.original_max_position_embeddings == ORIGINAL
    assert rope.attention_factor == pytest.approx((1 + torch.log(torch.tensor(4.0)).item() / torch.log(
        torch.tensor(128.0)).item()) ** 0.5)
    table = RotaryEmbedding(arch.head_dim, 512, rope, torch.float32)
    short = RotaryEmbedding(arch.head_dim, 512, dataclasses.replace(rope, long_factor=rope.short_factor),
                            torch.float32)
    assert torch.equal(table.cos_cache[:ORIGINAL], short.cos_cache[:ORIGINAL])
    assert not torch.allclose(table.cos_cache[ORIGINAL:], short.cos_cache[ORIGINAL:])
    with pytest.raises(ValueError, match="short_factor has 3 entries"):
        RotaryEmbedding(arch.head_dim, 512, dataclasses.replace(rope, short_factor=(1.0, 1.0, 1.0)), torch.float32)


def test_checkpoint_missing_a_fused_tensor_names_it(model_dirs: dict[str, str], tmp_path: os.PathLike[str]) -> None:
    from safetensors.torch import load_file, save_file

    src = model_dirs["phi3-longrope"]
    dst = os.path.join(tmp_path, "phi3-missing")
    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    tensors = load_file(path)
    assert "model.layers.1.mlp.gate_up_proj.weight" in tensors  # Phi-3 stores them fused
    del tensors["model.layers.1.mlp.gate_up_proj.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.gate_up_proj\.weight"):
        LLM(dst, dtype="float32", kv_cache_memory="1MiB")
