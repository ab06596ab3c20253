"""Tensor parallelism: greedy output token-identical to transformers (float32) at 2 and 4 ranks, a
process each (the multiprocess executor), for the Llama family: KV heads shared out and replicated
(fewer KV heads than ranks), alone and in mixed batches, with chunked prefill, prefix-cache hits,
preemption and async scheduling; and each rank holding its share of the weights."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from tests.models.test_golden import MAX_TOKENS, PROMPTS, check_prefix_hits, expected, run
from tokenmill import LLM


@contextmanager
def tp_llm(model_dir: str, tp: int, **kw: Any) -> Iterator[LLM]:
    llm = LLM(model_dir, dtype="float32", tensor_parallel_size=tp, **{"kv_cache_memory": "8MiB", **kw})
    try:
        yield llm
    finally:
        llm.shutdown()


@pytest.mark.parametrize(("name", "tp"), [
    ("llama-gqa4-untied", 2),  # 1 KV head, replicated on both ranks
    ("llama-gqa2-tied", 2),
    ("llama-gqa2-tied", 4),  # 2 KV heads over 4 ranks; tied embeddings split by vocabulary
    ("qwen2-mha", 2),  # q/k/v biases
    ("qwen3-qknorm", 2),
    ("mistral-window", 2),
    ("phi3-longrope", 2),  # fused q/k/v and gate/up checkpoint tensors, each rank taking its part of them
])
def test_single_and_batch(model_dirs: dict[str, str], name: str, tp: int) -> None:
    model_dir = model_dirs[name]
    with tp_llm(model_dir, tp) as llm:
        assert run(llm, PROMPTS[:1], MAX_TOKENS[:1]) == expected(model_dir, PROMPTS[:1], MAX_TOKENS[:1])
        assert run(llm, PROMPTS, MAX_TOKENS) == expected(model_dir, PROMPTS, MAX_TOKENS)


@pytest.mark.parametrize(("name", "tp"), [("llama-gqa4-untied", 2), ("qwen3-qknorm", 4)])
def test_chunked_prefill(model_dirs: dict[str, str], name: str, tp: int) -> None:
    model_dir = model_dirs[name]
    with tp_llm(model_dir, tp, max_num_batched_tokens=8, max_num_seqs=4) as llm:
        assert run(llm, PROMPTS, MAX_TOKENS) == expected(model_dir, PROMPTS, MAX_TOKENS)


def test_prefix_hits_preemption_and_async_scheduling(model_dirs: dict[str, str]) -> None:
    model_dir = model_dirs["llama-gqa2-tied"]
    with tp_llm(model_dir, 2, block_size=16, async_scheduling=True) as llm:
        check_prefix_hits(llm, model_dir)
    # 12 blocks of 8 tokens: max_model_len 96 fits, the batch does not
    with tp_llm(model_dir, 2, num_kv_blocks=12, block_size=8, max_model_len=96, kv_cache_memory=None) as llm:
        assert run(llm, PROMPTS, MAX_TOKENS) == expected(model_dir, PROMPTS, MAX_TOKENS)
        assert llm.engine.core.scheduler.num_preemptions > 0


def test_each_rank_holds_its_share(model_dirs: dict[str, str]) -> None:
    """Every sharded weight split in two, only the norms (hidden_size each) on both ranks; the KV cache
    budget shared out between the ranks."""
    model_dir = model_dirs["qwen2-mha"]  # 4 KV heads: no replication; untied embedding and lm_head
    single = LLM(model_dir, dtype="float32", kv_cache_memory="8MiB")
    whole = single.engine.core.executor.collective_rpc("weight_bytes")[0]
    model = single.engine.core.executor.runner.model  # type: ignore[attr-defined]
    norms = sum(p.numel() * 4 for n, p in model.named_parameters() if "norm" in n)
    with tp_llm(model_dir, 2) as llm:
        per_rank = llm.engine.core.executor.collective_rpc("weight_bytes")
        kv = llm.engine.core.executor.kv_cache_config
    assert per_rank == [(whole - norms) // 2 + norms] * 2
    one_rank_kv = single.engine.core.executor.kv_cache_config
    assert kv is not None and one_rank_kv is not None
    # each rank's blocks hold its half of the KV heads, and it takes half of the 8 MiB: as many blocks
    assert kv.bytes_per_block == one_rank_kv.bytes_per_block // 2 and kv.num_blocks == one_rank_kv.num_blocks


def test_random_sampling_agrees_with_one_rank(model_dirs: dict[str, str]) -> None:
    """Every rank samples from the same gathered logits with the same seeds, so the ranks' states stay
    equal (a rank that drew another token would feed it back and the outputs would part from one
    rank's at once); float32 logits differ from one rank's only in rounding, far below a draw's odds."""
    from tokenmill import SamplingParams

    model_dir = model_dirs["llama-gqa2-tied"]
    params = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, ignore_eos=True, seed=s) for s in (1, 2, 3)]
    params.append(SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True))  # the engine's generator

    def sample(llm: LLM) -> list[list[int]]:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:4], params, use_tqdm=False)]

    one = sample(LLM(model_dir, dtype="float32", kv_cache_memory="8MiB"))
    with tp_llm(model_dir, 2) as llm:
        assert sample(llm) == one
