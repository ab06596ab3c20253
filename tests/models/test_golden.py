"""Golden tests: greedy tokens identical to transformers `generate` (float32) on tiny random
checkpoints of every supported architecture, alone and batched, with chunked prefill,
preemption, prefix-cache hits, and the attention backends; the Triton backend on the CPU under
Triton's interpreter (a few families, slow), and on a GPU for every family with CUDA graphs on and off
(skipped without a GPU)."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

import tokenmill.config as config
from tests.conftest import random_prompts
from tests.fixtures import MODEL_SPECS, build_model, hf_greedy
from tokenmill import LLM, SamplingParams
from tokenmill.kernels import load_cpu_kernels
from tokenmill.kernels.triton.gemv import TritonGemv, gated_gemv
from tokenmill.layers import linear
from tokenmill.layers.linear import LinearBase, PanelGemm, WidenedGemv, use_triton_gemv

BACKENDS = ["torch_ref", "sdpa", "cpu"]
PROMPTS = random_prompts(9, 3, 60, seed=1)  # mistral's window (24) is shorter than most
MAX_TOKENS = [7, 30, 12, 25, 3, 18, 30, 9, 21]


@functools.cache
def reference(model_dir: str, prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    return hf_greedy(model_dir, list(prompt), max_tokens)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def run(llm: LLM, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    outs = llm.generate(prompts, [greedy(n) for n in max_tokens], use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def expected(model_dir: str, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    return [reference(model_dir, tuple(p), n) for p, n in zip(prompts, max_tokens)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(MODEL_SPECS))
def test_single_and_batch(model_dirs: dict[str, str], name: str, backend: str) -> None:
    model_dir = model_dirs[name]
    llm = LLM(model_dir, dtype="float32", kv_cache_memory="8MiB", attention_backend=backend)
    assert run(llm, PROMPTS[:1], MAX_TOKENS[:1]) == expected(model_dir, PROMPTS[:1], MAX_TOKENS[:1])
    assert run(llm, PROMPTS, MAX_TOKENS) == expected(model_dir, PROMPTS, MAX_TOKENS)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["llama-gqa4-untied", "mistral-window"])
def test_chunked_prefill(model_dirs: dict[str, str], name: str, backend: str) -> None:
    model_dir = model_dirs[name]
    llm = LLM(model_dir, dtype="float32", kv_cache_memory="8MiB", attention_backend=backend,
              max_num_batched_tokens=8, max_num_seqs=4)
    assert run(llm, PROMPTS, MAX_TOKENS) == expected(model_dir, PROMPTS, MAX_TOKENS)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["llama-gqa2-tied", "qwen3-qknorm"])
def test_preemption(model_dirs: dict[str, str], name: str, backend: str) -> None:
    model_dir = model_dirs[name]
    # 12 blocks of 8 tokens: max_model_len 96 fits, the batch does not
    llm = LLM(model_dir, dtype="float32", num_kv_blocks=12, block_size=8, max_model_len=96,
              attention_backend=backend)
    got = run(llm, PROMPTS, MAX_TOKENS)
    assert llm.engine.core.scheduler.num_preemptions > 0
    assert got == expected(model_dir, PROMPTS, MAX_TOKENS)
    assert llm.engine.core.scheduler.kv.num_free_blocks == 12


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["llama-gqa4-untied", "qwen2-mha", "mistral-window"])
def test_prefix_cache_hits(model_dirs: dict[str, str], name: str, backend: str) -> None:
    model_dir = model_dirs[name]
    llm = LLM(model_dir, dtype="float32", kv_cache_memory="8MiB", attention_backend=backend, block_size=16)
    check_prefix_hits(llm, model_dir)


def check_prefix_hits(llm: LLM, model_dir: str, n: int = 6) -> None:
    """n prompts sharing 40 tokens: the last n - 1 hit two 16-token blocks of the prefix cache."""
    shared = random_prompts(1, 40, 40, seed=7)[0]
    prompts = [shared + tail for tail in random_prompts(6, 1, 20, seed=8)][:n]
    max_tokens = [10, 4, 16, 8, 12, 6][:n]
    first = run(llm, prompts[:1], max_tokens[:1])
    kv = llm.engine.core.scheduler.kv
    hits_before = kv.prefix_hits
    rest = run(llm, prompts[1:], max_tokens[1:])
    assert kv.prefix_hits - hits_before >= (n - 1) * 32
    assert first + rest == expected(model_dir, prompts, max_tokens)


def test_triton_backend(model_dirs: dict[str, str]) -> None:
    # a sliding window over GQA; chunks of 12 tokens over 16-token blocks (cached prefixes that end inside a
    # block), then prefix-cache hits. Few, short requests: on the CPU the kernels run in the interpreter
    model_dir = model_dirs["mistral-window"]
    llm = LLM(model_dir, dtype="float32", kv_cache_memory="8MiB", attention_backend="triton", block_size=16,
              max_num_batched_tokens=12, max_num_seqs=4)
    prompts, max_tokens = [PROMPTS[1], PROMPTS[3]], [6, 5]
    assert run(llm, prompts, max_tokens) == expected(model_dir, prompts, max_tokens)
    check_prefix_hits(llm, model_dir, 3)


@pytest.mark.parametrize("name", ["llama-gqa4-untied", "llama-gqa2-tied", "gemma2-softcap", "mixtral-8x-top2",
                                  "qwen2moe-shared", "qwen3moe-norm"])
# panels: every weight not read outside its layer in bf16_panels' layout, bf16p_gemm for every row count; widened:
# every weight as loaded, the widening GEMV for decode rows and bf16w_gemm for prefill chunks
@pytest.mark.parametrize("layout", ["panels", "widened"])
def test_bf16_checkpoint_on_a_cpu_without_bf16(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: str,
                                               monkeypatch: pytest.MonkeyPatch, name: str, layout: str) -> None:
    # dtype auto on an AVX2-only CPU: a bf16 checkpoint runs in float32 with its linear weights (routed and shared
    # experts' too; not the float32 routers) kept in bf16 and widened in the product, against transformers in
    # float32 over the same bf16 weights; forced here on any CPU
    kernels = load_cpu_kernels()
    if kernels is None or int(kernels.bf16w_gemv_max_rows()) == 0:
        pytest.skip("the C++ bf16 GEMV (AVX2) is not built here")
    monkeypatch.setattr(config, "cpu_runs_bf16", lambda: False)
    if layout == "widened":
        monkeypatch.setattr(linear, "panels_take", lambda layer: False)
    model_dir = build_model(name, str(tmp_path_factory.mktemp("bf16") / name), tokenizer_dir, dtype="bfloat16")
    llm = LLM(model_dir, kv_cache_memory="8MiB", max_num_seqs=4)
    assert llm.engine.config.model.dtype == "float32"
    assert llm.engine.config.model.linear_weight_dtype == "bfloat16"
    model = llm.engine.core.executor.worker.model
    assert model.lm_head.weight.dtype == model.embed_tokens.weight.dtype == torch.bfloat16
    assert not model.lm_head.packed
    calls = {"gemv": 0, "gemm": 0, "panels": 0}

    def counted(name: str, op: Any) -> Any:
        def call(*args: Any) -> Any:
            calls[name] += 1
            return op(*args)
        return call

    layers = [m for m in model.modules() if isinstance(m, LinearBase)]
    in_panels = layers if layout == "panels" else []  # a tied lm_head's too: the embedding reads its panels
    assert all(isinstance(m.gemv_ops, PanelGemm) for m in in_panels)
    assert all(isinstance(m.gemv_ops, WidenedGemv) for m in layers if m not in in_panels)
    for m in layers:
        if m in in_panels:
            monkeypatch.setattr(m.gemv_ops, "packed_gemv", counted("panels", kernels.bf16p_gemm))
        else:
            monkeypatch.setattr(m.gemv_ops, "packed_gemv", counted("gemv", kernels.bf16w_gemv))
            monkeypatch.setattr(m.gemv_ops, "gemm", counted("gemm", kernels.bf16w_gemm))
    prompts, max_tokens = PROMPTS[:4], MAX_TOKENS[:4]
    assert run(llm, prompts, max_tokens) == [hf_greedy(model_dir, p, n) for p, n in zip(prompts, max_tokens)]
    if layout == "panels":
        assert calls["panels"] > 0 and calls["gemv"] == calls["gemm"] == 0
    else:
        assert calls["gemv"] > 0 and calls["gemm"] > 0 and calls["panels"] == 0  # decode rows; prefill chunks


def test_triton_gemv(model_dirs: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    # the GPU's decode path on the CPU, under the interpreter: the Triton GEMV in every linear layer (decode
    # steps of one row, as the requests of different lengths finish; the lm_head's included) and in the MLP's
    # gated down projection; float32 weights stay unpacked so that the GEMV takes them (on a CPU without
    # oneDNN bf16 they are packed)
    monkeypatch.setattr(linear, "float32_packing_available", lambda: False)
    model_dir = model_dirs["llama-gqa4-untied"]  # (an untied lm_head: a linear layer of its own)
    llm = LLM(model_dir, dtype="float32", kv_cache_memory="8MiB", attention_backend="triton", block_size=16,
              max_num_seqs=4, enforce_eager=True)  # (on a GPU: graphs replay the GEMV without these calls)
    model = llm.engine.core.executor.worker.model
    calls = {"gemv": 0, "gated": 0}
    gemv_calls = TritonGemv.packed_gemv

    def count(name: str, fn: Any) -> Any:
        def counted(*args: Any) -> Any:
            calls[name] += 1
            return fn(*args)
        return counted

    monkeypatch.setattr(TritonGemv, "packed_gemv", staticmethod(count("gemv", gemv_calls)))
    # the gated form, which the layers are not offered by default (tools/gpu_bench.py --gated on offers it)
    monkeypatch.setattr(TritonGemv, "gated_gemv", staticmethod(count("gated", gated_gemv)))
    # (after the counters: a layer resolves the gated form once, when it takes the GEMV)
    assert use_triton_gemv(model, TritonGemv()) > 0 and model.lm_head.gemv_ops is not None
    prompts, max_tokens = PROMPTS[:3], [6, 9, 4]
    assert run(llm, prompts, max_tokens) == expected(model_dir, prompts, max_tokens)
    assert calls["gemv"] > 0 and calls["gated"] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the lent device)")
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["cuda-graphs", "eager"])
@pytest.mark.parametrize("name", list(MODEL_SPECS))
def test_cuda_triton(model_dirs: dict[str, str], name: str, enforce_eager: bool) -> None:
    # max_num_seqs 8: decode batches of 1 to 8 rows replay the graphs of sizes 1, 2, 4 and 8, padded
    model_dir = model_dirs[name]
    llm = LLM(model_dir, dtype="float32", kv_cache_memory="64MiB", device="cuda", attention_backend="triton",
              enforce_eager=enforce_eager, block_size=16, max_num_batched_tokens=24, max_num_seqs=8)
    assert run(llm, PROMPTS[:1], MAX_TOKENS[:1]) == expected(model_dir, PROMPTS[:1], MAX_TOKENS[:1])
    assert run(llm, PROMPTS, MAX_TOKENS) == expected(model_dir, PROMPTS, MAX_TOKENS)
    check_prefix_hits(llm, model_dir)
    runner = llm.engine.core.executor.worker.model_runner
    if enforce_eager:
        assert runner.graphs is None
    elif runner.graphs is not None:  # (None for MoE and MLA models, which decode eagerly)
        assert runner.graphs.replays > 0
        assert runner.launched > 0  # greedy decode steps were launched ahead (ModelRunner.launch)
