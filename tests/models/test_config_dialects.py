"""Both config.json dialects of the MoE, MLA and Phi-3 families: a checkpoint whose config is written as
transformers 4 wrote it (`torch_dtype`, `rope_theta`, `rope_scaling` with `type`, a top-level
`partial_rotary_factor`) parses to the same ArchConfig as transformers 5's and generates transformers'
greedy tokens (the Llama family: tests/models/test_loading.py; Gemma's own dialect: test_gemma.py)."""

from __future__ import annotations

import json
import os

import pytest

from tests.conftest import random_prompts
from tests.fixtures import greedy_ids, hf_expected, to_transformers4_dialect
from tokenmill import LLM
from tokenmill.arch import parse_arch_config

FAMILIES = ["mixtral-8x-top2", "qwen2moe-shared", "qwen3moe-norm", "deepseek-v2-mla", "deepseek-v3-mla",
            "phi3-longrope", "phi3-partial-window"]


@pytest.mark.parametrize("name", FAMILIES)
def test_transformers4_dialect_generates_alike(model_dirs: dict[str, str], name: str,
                                               tmp_path: os.PathLike[str]) -> None:
    src = model_dirs[name]
    with open(os.path.join(src, "config.json")) as f:
        v5 = json.load(f)
    assert "rope_parameters" in v5 and "dtype" in v5  # written by transformers 5
    v4 = to_transformers4_dialect(v5)
    assert "rope_parameters" not in v4 and "rope_theta" in v4
    assert parse_arch_config(v4) == parse_arch_config(v5)
    dst = os.path.join(tmp_path, "v4")
    os.makedirs(dst)
    for f in os.listdir(src):  # weights and tokenizer as they are
        if f != "config.json":
            os.symlink(os.path.join(src, f), os.path.join(dst, f))
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(v4, f)
    prompts, max_tokens = random_prompts(2, 5, 40, seed=31), [12, 9]
    llm = LLM(dst, dtype="float32", kv_cache_memory="4MiB")
    assert greedy_ids(llm, prompts, max_tokens) == hf_expected(src, prompts, max_tokens)
