"""(CPU) the fused decode path (worker/fused_decode.py: ops.decode_layers, the layer loop of a pure-decode
step in one C++ call) against the Python
layer loop it replaces: it calls the same kernels on the same tensors, so tokens and logprobs must
be bitwise equal, for every architecture it takes (Llama, Qwen2's qkv bias, Mistral's window, Phi-3's
longrope tables, Mixtral's routed experts)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import random_prompts
from tokenmill import LLM, SamplingParams
from tokenmill.kernels import load_cpu_kernels
from tokenmill.layers.linear import gemv_layout_ok
from tokenmill.worker.fused_decode import FusedDecode

OPS = load_cpu_kernels()
FUSED = ["llama-gqa2-tied", "llama-gqa4-untied", "qwen2-mha", "mistral-window", "phi3-longrope", "mixtral-8x-top2"]
pytestmark = pytest.mark.skipif(OPS is None or not OPS.has_packed_gemv() or not gemv_layout_ok(OPS),
                                reason="needs the C++ kernels with the AVX512-BF16 GEMV on oneDNN's AB16b64a2b")


def _use_fused(llm: LLM, ops: Any, fused: bool) -> None:
    """The runner's fused decode path through `ops`, or none: the Python layer loop, the reference."""
    runner = llm.engine.core.executor.runner
    runner.fused_decode = FusedDecode.create(runner.model, ops, runner.backend) if fused else None
    if fused and not runner.fused_decode.quant:  # every projection's GEMV is called by address, not through the op
        ptrs = runner.fused_decode.gemv_ptrs
        moe = runner.model.cfg.moe
        sparse = 0 if moe is None else moe.num_sparse_layers  # qkv, o and each expert's gate_up and down
        per_sparse = 0 if moe is None else 2 + 2 * moe.num_experts
        assert ptrs.numel() == 4 * (len(runner.model.layers) - sparse) + per_sparse * sparse
        assert bool((ptrs != 0).all())


class CountingOps:
    def __init__(self, ops: Any, name: str = "decode_layers") -> None:
        self.ops, self.name, self.calls = ops, name, 0

    def __getattr__(self, name: str) -> Any:
        if name == self.name:
            self.calls += 1
        return getattr(self.ops, name)


def _run(model_dir: str, fused: bool, num_prompts: int, params: Any = None, count: str = "decode_layers",
         **engine_args: Any) -> tuple[list[Any], int]:
    llm = LLM(model_dir, dtype="bfloat16", kv_cache_memory="4MiB", device="cpu", **engine_args)
    counter = CountingOps(OPS, count)
    _use_fused(llm, counter, fused)
    prompts = random_prompts(num_prompts, 3, 40, seed=num_prompts)
    params = params or SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=3)
    return llm.generate(prompts, params, use_tqdm=False), counter.calls


@pytest.mark.parametrize("name", FUSED)
# 9: past the GEMV, oneDNN's packed linear; 17: oneDNN run in 18 rows (layers/linear.py onednn_rows)
@pytest.mark.parametrize("num_prompts", [1, 4, 9, 17])
def test_decode_layers_matches_the_python_loop(model_dirs: dict[str, str], name: str, num_prompts: int) -> None:
    fast, fast_calls = _run(model_dirs[name], True, num_prompts)
    ref, ref_calls = _run(model_dirs[name], False, num_prompts)
    assert fast_calls >= 25 and ref_calls == 0  # the fused path ran for (nearly) every decode step
    for a, b in zip(fast, ref, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs  # bitwise: the same kernels in the same order


@pytest.mark.parametrize("quantization", ["int8", "int4", "w8a8"])
@pytest.mark.parametrize("name,num_prompts", [("llama-gqa4-untied", 1), ("qwen2-mha", 4), ("llama-gqa2-tied", 17),
                                             ("llama-gqa2-tied", 18)])  # 17 rows: oneDNN's run in 18
def test_decode_layers_with_quantized_projections(model_dirs: dict[str, str], name: str, num_prompts: int,
                                                  quantization: str) -> None:
    # the same quantized weights through the fused loop and through the Python layer loop; 18 prompts: steps
    # of over 16 rows run other kernels in the layers: int8/int4 the AMX one (dequant_amx.cpp) where AMX-BF16
    # runs, which the fused path calls as the layers do, else the torch reference, which it declines; W8A8
    # oneDNN's int8 matmul, which it calls as the layers do
    fast, fast_calls = _run(model_dirs[name], True, num_prompts, quantization=quantization)
    ref, ref_calls = _run(model_dirs[name], False, num_prompts, quantization=quantization)
    assert ref_calls == 0
    takes_all = num_prompts <= 16 or quantization == "w8a8" or bool(OPS.has_dequant_amx())
    assert fast_calls >= 25 if takes_all else fast_calls <= 14
    for a, b in zip(fast, ref, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs  # bitwise: the same kernels in the same order


@pytest.mark.parametrize("kv_cache_dtype,quantization", [("int8", None), ("fp8_e4m3", None), ("int8", "int4")])
@pytest.mark.parametrize("name,num_prompts", [("llama-gqa4-untied", 1), ("qwen2-mha", 4), ("mistral-window", 9)])
def test_decode_layers_with_a_quantized_kv_cache(model_dirs: dict[str, str], name: str, num_prompts: int,
                                                 kv_cache_dtype: str, quantization: str | None) -> None:
    # the fused loop stores and reads the int8 / fp8 cache with the ops the C++ backend calls: bitwise equal
    args = dict(kv_cache_dtype=kv_cache_dtype, quantization=quantization)
    fast, fast_calls = _run(model_dirs[name], True, num_prompts, **args)
    ref, ref_calls = _run(model_dirs[name], False, num_prompts, **args)
    assert fast_calls >= 25 and ref_calls == 0
    for a, b in zip(fast, ref, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


# int8 and int4 round the lm_head to int8 as well (a tied one beside the embedding's float table), which the call
# runs too; W8A8's stays float
@pytest.mark.parametrize("quantization,num_prompts,name", [
    ("int8", 3, "llama-gqa4-untied"), ("int4", 3, "llama-gqa4-untied"), ("int4", 3, "llama-gqa2-tied"),
    ("w8a8", 3, "llama-gqa4-untied"), ("w8a8", 20, "llama-gqa4-untied")])
def test_decode_greedy_with_quantized_projections(model_dirs: dict[str, str], quantization: str,
                                                  num_prompts: int, name: str) -> None:
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    model = model_dirs[name]
    fast, fast_calls = _run(model, True, num_prompts, params, "decode_greedy", quantization=quantization)
    ref, _ = _run(model, False, num_prompts, params, "decode_greedy", quantization=quantization)
    assert fast_calls >= 20
    assert [o.outputs[0].token_ids for o in fast] == [o.outputs[0].token_ids for o in ref]


@pytest.mark.parametrize("name", FUSED)
@pytest.mark.parametrize("num_prompts", [1, 9])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_decode_greedy_matches_the_python_path(model_dirs: dict[str, str], name: str, num_prompts: int,
                                               async_scheduling: bool) -> None:
    # ops.decode_greedy (embedding, layers, lm_head, argmax in one call) against the Python layer loop,
    # compute_logits and the sampler; min_tokens keeps the first steps off it (not plain greedy then)
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, min_tokens=4 if i % 2 else 0)
              for i in range(num_prompts)]
    fast, fast_calls = _run(model_dirs[name], True, num_prompts, params, "decode_greedy",
                            async_scheduling=async_scheduling)
    ref, ref_calls = _run(model_dirs[name], False, num_prompts, params, "decode_greedy",
                          async_scheduling=async_scheduling)
    assert ref_calls == 0
    # every pure-decode step once each row is past min_tokens: 29 decode steps, the first 3 not fused
    # where any row has min_tokens (the step of a later-admitted prompt is not pure decode either)
    assert 20 <= fast_calls <= 29 - (3 if num_prompts > 1 else 0)
    for a, b in zip(fast, ref, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_decode_greedy_through_preemption(model_dirs: dict[str, str], async_scheduling: bool) -> None:
    # 12 blocks of 8 tokens for 9 prompts: requests are preempted and resumed between fused steps
    prompts = random_prompts(9, 3, 40, seed=9)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    outs, calls = [], []
    for fused in (True, False):
        llm = LLM(model_dirs["llama-gqa4-untied"], dtype="bfloat16", device="cpu", num_kv_blocks=12, block_size=8,
                  max_model_len=96, async_scheduling=async_scheduling)
        counter = CountingOps(OPS, "decode_greedy")
        _use_fused(llm, counter, fused)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        calls.append(counter.calls)
        assert llm.engine.core.scheduler.num_preemptions > 0
        assert llm.engine.core.scheduler.kv.num_free_blocks == 12
    assert calls[0] > 20 and calls[1] == 0
    assert outs[0] == outs[1]


def test_decode_greedy_is_not_taken_for_sampled_rows(model_dirs: dict[str, str]) -> None:
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=1, max_tokens=12, ignore_eos=True)]
    _, calls = _run(model_dirs["llama-gqa4-untied"], True, 2, params, "decode_greedy")
    assert calls == 0


def test_decode_layers_is_off_where_it_does_not_apply(model_dirs: dict[str, str]) -> None:
    llm = LLM(model_dirs["llama-gqa2-tied"], dtype="bfloat16", kv_cache_memory="4MiB", device="cpu")
    assert llm.engine.core.executor.runner.fused_decode is not None
    # q/k norms: not fused
    llm = LLM(model_dirs["qwen3-qknorm"], dtype="bfloat16", kv_cache_memory="4MiB", device="cpu")
    assert llm.engine.core.executor.runner.fused_decode is None
    # no packed bf16 GEMV
    llm = LLM(model_dirs["llama-gqa2-tied"], dtype="float32", kv_cache_memory="4MiB", device="cpu")
    assert llm.engine.core.executor.runner.fused_decode is None
    llm = LLM(model_dirs["llama-gqa2-tied"], dtype="bfloat16", kv_cache_memory="4MiB", device="cpu",
              attention_backend="torch_ref")  # not the C++ attention backend's tables
    assert llm.engine.core.executor.runner.fused_decode is None


class HalfRight:
    """k drafts that follow a known sequence but for the last, which is off by one: every verification
    accepts some and rejects one."""

    def __init__(self, sequences: list[list[int]], k: int) -> None:
        self.sequences, self.k = sequences, k

    def propose(self, batch: Any) -> dict[str, list[int]]:
        out = {}
        for rid, tokens in zip(batch.req_ids, batch.token_ids, strict=True):
            for seq in self.sequences:
                if len(seq) > len(tokens) and seq[:len(tokens)] == tokens:
                    drafts = seq[len(tokens):len(tokens) + self.k]
                    out[rid] = drafts[:-1] + [(drafts[-1] + 1) % 500 + 2]
                    break
        return out


@pytest.mark.parametrize("num_prompts", [1, 3, 9])  # 9: past the GEMV's rows, oneDNN's packed linear
@pytest.mark.parametrize("logprobs", [None, 2])  # None: plain greedy, ops.decode_greedy; else decode_layers
def test_verification_as_decode_rows_matches_the_python_loop(model_dirs: dict[str, str], num_prompts: int,
                                                             logprobs: int | None) -> None:
    """A step of decodes and verification runs, as decode rows through the fused call, against the Python
    layer loop over the same decode rows: bitwise the same tokens and logprobs, with drafts accepted and
    rejected, through chunked prefill (requests join while others verify)."""
    prompts = random_prompts(num_prompts, 3, 40, seed=num_prompts)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=logprobs)
    args = dict(dtype="bfloat16", kv_cache_memory="4MiB", device="cpu", block_size=8, async_scheduling=False,
                max_num_batched_tokens=32)
    plain = LLM(model_dirs["llama-gqa4-untied"], **args).generate(prompts, params, use_tqdm=False)
    sequences = [p + o.outputs[0].token_ids for p, o in zip(prompts, plain, strict=True)]
    outs, calls = [], []
    for fused in (True, False):
        llm = LLM(model_dirs["llama-gqa4-untied"], **args)
        runner = llm.engine.core.executor.runner
        counter = CountingOps(OPS, "decode_greedy" if logprobs is None else "decode_layers")
        _use_fused(llm, counter, fused)
        runner.verify_as_decode_rows = True  # the reference: the layer loop over the same rows
        runner.set_proposer(HalfRight(sequences, 3))
        outs.append([(o.outputs[0].token_ids, o.outputs[0].logprobs)
                     for o in llm.generate(prompts, params, use_tqdm=False)])
        calls.append(counter.calls)
        sched = llm.engine.core.scheduler
        assert sched.spec.num_accepted_tokens > 0 and sched.spec.num_draft_tokens > sched.spec.num_accepted_tokens
        assert sched.kv.num_free_blocks == sched.kv.pool.num_blocks
    assert calls[0] >= 5 and calls[1] == 0
    assert outs[0] == outs[1]
