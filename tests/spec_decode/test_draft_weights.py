"""The draft model's weights and elementwise layers follow the target's float treatment: on a CPU without bf16
products (forced here on any CPU), a bf16 target keeps its linear weights in bf16 under a float32 model, and so
does a bf16 draft, while a float32 draft checkpoint keeps float32 weights; both drafts' norms take the float32
fused ops, and speculation leaves the greedy output as it was."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from tests.conftest import random_prompts
from tokenmill import LLM, SamplingParams, config
from tokenmill.kernels import load_cpu_kernels
from tokenmill.layers.linear import LinearBase
from tokenmill.layers.norm import RMSNorm


def _as_bf16(src: str, out: str) -> str:
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).to(torch.bfloat16).save_pretrained(out)
    for f in os.listdir(src):
        if "token" in f or f.endswith(".jinja"):
            shutil.copy(os.path.join(src, f), out)
    return out


def test_the_draft_keeps_bf16_weights_only_from_a_bf16_checkpoint(llama_dir: str, draft_dir: str, tmp_path: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    kernels = load_cpu_kernels()
    if kernels is None or int(kernels.bf16w_gemv_max_rows()) == 0:
        pytest.skip("the C++ bf16 GEMV (AVX2) is not built here")
    monkeypatch.setattr(config, "cpu_runs_bf16", lambda: False)
    target = _as_bf16(llama_dir, os.path.join(tmp_path, "target"))
    prompts = [{"prompt_token_ids": p} for p in random_prompts(3, 5, 30, seed=11)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = LLM(target, kv_cache_memory="8MiB")
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    for draft, weights in [(_as_bf16(draft_dir, os.path.join(tmp_path, "draft")), torch.bfloat16),
                           (draft_dir, torch.float32)]:
        spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3, "adaptive": False}
        llm = LLM(target, kv_cache_memory="8MiB", speculative_config=spec)
        assert llm.engine.config.model.linear_weight_dtype == "bfloat16"
        model = llm.engine.core.executor.worker.model_runner.proposer.proposer.model
        assert {m.weight.dtype for m in model.modules() if isinstance(m, LinearBase)} == {weights}
        norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
        assert norms and all(m.ops is not None and m.fused_dtypes == (torch.float32,) for m in norms)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
