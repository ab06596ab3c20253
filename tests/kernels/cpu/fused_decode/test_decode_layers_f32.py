"""(CPU) the fused decode path for float32 models (an AVX2-only CPU's dtype auto) against the Python layer
loop it replaces: ops.decode_layers / decode_greedy with float32 rows call the kernels' float32 forms (norms,
rotary, the KV store, paged decode, SiLU-and-mul) and the projections the layers call (the panels' product or
the widening GEMV over bf16-stored weights, oneDNN's packed float32 product; a Mixtral's routed experts too), so
tokens and logprobs must be bitwise equal. The CPU without bf16 arithmetic is forced where it is not one
(config.cpu_runs_bf16), as the golden tests force it."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from tests.conftest import random_prompts
from tests.fixtures import build_model
from tokenmill import LLM, SamplingParams, config
from tokenmill.kernels import load_cpu_kernels
from tokenmill.layers import linear
from tokenmill.layers.linear import LinearBase, PanelGemm, UnquantizedLinearMethod, WidenedGemv
from tokenmill.worker.fused_decode import ONEDNN_ONLY, PANELS, WIDENED, FusedDecode

OPS = load_cpu_kernels()
pytestmark = pytest.mark.skipif(OPS is None or int(OPS.bf16w_gemv_max_rows()) == 0,
                                reason="needs the C++ kernels with the widening bf16 GEMV (AVX2)")
FUSED = ["llama-gqa2-tied", "llama-gqa4-untied", "qwen2-mha", "mistral-window", "phi3-longrope", "mixtral-8x-top2"]


@pytest.fixture(scope="module")
def bf16_dirs(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: str) -> dict[str, str]:
    root = tmp_path_factory.mktemp("bf16")
    return {name: build_model(name, os.path.join(root, name), tokenizer_dir, dtype="bfloat16")
            for name in FUSED}


@pytest.fixture(autouse=True)
def no_bf16_arithmetic(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config, "cpu_runs_bf16", lambda: False)


class CountingOps:
    def __init__(self, ops: Any, name: str) -> None:
        self.ops, self.name, self.calls = ops, name, 0

    def __getattr__(self, name: str) -> Any:
        if name == self.name:
            self.calls += 1
        return getattr(self.ops, name)


def _llm(model_dir: str, **engine_args: Any) -> LLM:
    args: dict[str, Any] = dict(kv_cache_memory="4MiB", device="cpu")
    return LLM(model_dir, **(args | engine_args))


def _run(llm: LLM, fused: bool, prompts: list[Any], params: Any, count: str) -> tuple[list[Any], int]:
    """`llm`'s outputs with the fused path or the Python loop; a fresh `llm` for each (no prefix hits, which
    would compute the prompts in other chunks)."""
    runner = llm.engine.core.executor.runner
    counter = CountingOps(OPS, count)
    runner.fused_decode = FusedDecode.create(runner.model, counter, runner.backend) if fused else None
    return llm.generate(prompts, params, use_tqdm=False), counter.calls


def _linear_layers(llm: LLM) -> list[LinearBase]:
    return [m for m in llm.engine.core.executor.runner.model.modules() if isinstance(m, LinearBase)]


@pytest.mark.parametrize("name", FUSED)
# panels: bf16p_gemm for any rows; widened (every weight as loaded): the widening GEMV up to its 16 rows,
# bf16w_gemm past them (17)
@pytest.mark.parametrize("layout", ["panels", "widened"])
@pytest.mark.parametrize("num_prompts", [1, 4, 16, 17])
def test_bf16_stored_float32_model_matches_the_python_loop(bf16_dirs: dict[str, str], name: str, layout: str,
                                                           num_prompts: int, monkeypatch: pytest.MonkeyPatch) -> None:
    if layout == "widened":
        monkeypatch.setattr(linear, "panels_take", lambda layer: False)
    llm = _llm(bf16_dirs[name])
    runner = llm.engine.core.executor.runner
    assert llm.engine.config.model.dtype == "float32" and llm.engine.config.model.linear_weight_dtype == "bfloat16"
    assert runner.fused_decode is not None  # the runner takes it by itself
    assert bool((runner.fused_decode.gemv_ptrs == (PANELS if layout == "panels" else WIDENED)).all())
    kind = PanelGemm if layout == "panels" else WidenedGemv
    assert all(isinstance(m.gemv_ops, kind) for m in _linear_layers(llm))  # a tied lm_head's too
    model = runner.model
    tied = llm.engine.config.model.arch.tie_word_embeddings
    assert (model.embed_tokens.weight is model.lm_head.weight) == tied  # one tensor, in either layout
    prompts = random_prompts(num_prompts, 3, 40, seed=num_prompts)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=3)
    fast, fast_calls = _run(llm, True, prompts, params, "decode_layers")
    ref, ref_calls = _run(_llm(bf16_dirs[name]), False, prompts, params, "decode_layers")
    assert ref_calls == 0
    assert fast_calls >= 25
    for a, b in zip(fast, ref, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs  # bitwise: the same kernels in the same order


@pytest.mark.parametrize("num_prompts", [1, 9])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_widened_decode_greedy_matches_the_python_path(bf16_dirs: dict[str, str], num_prompts: int,
                                                       async_scheduling: bool) -> None:
    # embedding (the bf16 table widened), layers, lm_head (bf16-stored, widened) and the float32 argmax in one call
    llm = _llm(bf16_dirs["llama-gqa2-tied"], async_scheduling=async_scheduling)
    prompts = random_prompts(num_prompts, 3, 40, seed=num_prompts)
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, min_tokens=4 if i % 2 else 0)
              for i in range(num_prompts)]
    fast, fast_calls = _run(llm, True, prompts, params, "decode_greedy")
    ref, ref_calls = _run(_llm(bf16_dirs["llama-gqa2-tied"], async_scheduling=async_scheduling), False, prompts,
                          params, "decode_greedy")
    assert ref_calls == 0 and 20 <= fast_calls <= 29
    assert [o.outputs[0].token_ids for o in fast] == [o.outputs[0].token_ids for o in ref]


@pytest.mark.parametrize("name", ["llama-gqa4-untied", "mixtral-8x-top2"])
def test_float32_checkpoint_with_packed_float32_weights(model_dirs: dict[str, str], name: str) -> None:
    # a float32 checkpoint where oneDNN has no bf16 path: its weights (a Mixtral's experts too) packed in float32
    # (oneDNN's product, no GEMV)
    llm = _llm(model_dirs[name])
    runner = llm.engine.core.executor.runner
    method = next(m.method for m in _linear_layers(llm) if isinstance(m.method, UnquantizedLinearMethod))
    if not method.pack_float32:
        assert runner.fused_decode is None  # unpacked float32 weights: neither GEMV nor oneDNN's packed product
        pytest.skip("oneDNN packs bf16 weights here, so float32 ones stay unpacked")
    assert runner.fused_decode is not None and bool((runner.fused_decode.gemv_ptrs == ONEDNN_ONLY).all())
    prompts = random_prompts(5, 3, 40, seed=5)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    fast, fast_calls = _run(llm, True, prompts, params, "decode_layers")
    ref, _ = _run(_llm(model_dirs[name]), False, prompts, params, "decode_layers")
    assert fast_calls >= 20
    for a, b in zip(fast, ref, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


def test_float32_rows_decline_what_the_kernel_takes_in_bf16_only(bf16_dirs: dict[str, str]) -> None:
    # quantized projections and a quantized cache stay on the Python loop in float32
    assert _llm(bf16_dirs["llama-gqa2-tied"], quantization="int8").engine.core.executor.runner.fused_decode is None
    assert _llm(bf16_dirs["llama-gqa2-tied"],
                kv_cache_dtype="int8").engine.core.executor.runner.fused_decode is None
    # --no-cpu-kernels: the layers run torch's ops, so neither does the fused call (the cpu backend asked for)
    assert _llm(bf16_dirs["llama-gqa2-tied"], cpu_kernels=False,
                attention_backend="cpu").engine.core.executor.runner.fused_decode is None


def test_the_kernel_checks_float32_rows(bf16_dirs: dict[str, str]) -> None:
    llm = _llm(bf16_dirs["llama-gqa2-tied"])
    fused = llm.engine.core.executor.runner.fused_decode
    assert fused is not None
    cos, sin, weights, ptrs, final_norm = fused._static
    with pytest.raises(RuntimeError, match="cos/sin"):  # cos/sin of another dtype than the rows
        ops_args = (cos.to(torch.bfloat16), sin, weights, ptrs, final_norm)
        OPS.decode_layers(torch.zeros(1, final_norm.numel(), dtype=torch.float32), torch.zeros(1, dtype=torch.long),
                          *ops_args, fused.kv_caches, torch.zeros(1, dtype=torch.long),
                          torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), *fused._dims)
