"""Pipeline parallelism: greedy output token-identical to transformers (float32) at 2 stages and at 2
tensor-parallel ranks x 2 stages (a process per rank, the multiprocess executor), alone and in mixed
batches, with chunked prefill, prefix-cache hits, preemption, and steps one at a time or overlapping on
the stages (async scheduling: the two steps in flight hold different requests); each stage holding
only its layers' weights (the embedding on the first, the final norm and lm_head on the last) and its
layers' KV cache."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import random_prompts
from tests.models.test_golden import MAX_TOKENS, PROMPTS, check_prefix_hits, expected, greedy, run
from tokenmill import LLM


@contextmanager
def pp_llm(model_dir: str, pp: int, tp: int = 1, **kw: Any) -> Iterator[LLM]:
    llm = LLM(model_dir, dtype="float32", pipeline_parallel_size=pp, tensor_parallel_size=tp,
              **{"kv_cache_memory": "8MiB", **kw})
    try:
        yield llm
    finally:
        llm.shutdown()


def whole_model(model_dir: str) -> tuple[int, dict[str, int], Any]:
    """One rank's weight bytes, each parameter's bytes by name, and its KV cache plan."""
    llm = LLM(model_dir, dtype="float32", kv_cache_memory="8MiB")
    executor = llm.engine.core.executor
    model = executor.runner.model  # type: ignore[attr-defined]
    sizes = {n: p.numel() * p.element_size() for n, p in model.named_parameters()}
    return executor.collective_rpc("weight_bytes")[0], sizes, executor.kv_cache_config


@pytest.mark.parametrize(("name", "async_scheduling"), [
    ("llama-gqa2-tied", False),  # one step at a time; the last stage loads the tied embedding into its lm_head
    ("qwen3-qknorm", True),  # two steps in flight, of different requests, one on each stage
])
def test_two_stages(model_dirs: dict[str, str], name: str, async_scheduling: bool) -> None:
    model_dir = model_dirs[name]
    with pp_llm(model_dir, 2, async_scheduling=async_scheduling) as llm:
        assert run(llm, PROMPTS[:1], MAX_TOKENS[:1]) == expected(model_dir, PROMPTS[:1], MAX_TOKENS[:1])
        assert run(llm, PROMPTS, MAX_TOKENS) == expected(model_dir, PROMPTS, MAX_TOKENS)


def test_each_stage_holds_its_layers(model_dirs: dict[str, str]) -> None:
    """Stage 0: the embedding and layer 0; stage 1: layer 1, the final norm and the lm_head (untied); so
    the two stages' bytes add up to one rank's, about half each. Each stage's KV blocks hold its layer
    only, and it takes half of the 8 MiB: as many blocks as one rank."""
    model_dir = model_dirs["qwen2-mha"]  # untied embedding and lm_head
    whole, sizes, one_rank_kv = whole_model(model_dir)
    with pp_llm(model_dir, 2) as llm:
        per_rank = llm.engine.core.executor.collective_rpc("weight_bytes")
        kv = llm.engine.core.executor.kv_cache_config
    first = sum(n for name, n in sizes.items() if name.startswith(("embed_tokens.", "layers.0.")))
    assert per_rank == [first, whole - first]
    assert max(per_rank) < 0.55 * whole
    assert kv is not None and one_rank_kv is not None
    assert kv.bytes_per_block == one_rank_kv.bytes_per_block // 2 and kv.num_blocks == one_rank_kv.num_blocks
    assert [g.layer_names for g in kv.groups] == [("layers.0.self_attn.attn",)]


def test_tensor_x_pipeline(model_dirs: dict[str, str]) -> None:
    """2 x 2 ranks over 1 KV head (replicated on a stage's two ranks), chunked prefill in mixed batches,
    two steps in flight; each rank holds about a quarter of the weights."""
    model_dir = model_dirs["llama-gqa4-untied"]
    whole, sizes, _ = whole_model(model_dir)
    with pp_llm(model_dir, 2, tp=2, max_num_batched_tokens=8, max_num_seqs=4, async_scheduling=True) as llm:
        assert run(llm, PROMPTS, MAX_TOKENS) == expected(model_dir, PROMPTS, MAX_TOKENS)
        per_rank = llm.engine.core.executor.collective_rpc("weight_bytes")
    norms = sum(n for name, n in sizes.items() if "norm" in name)
    kv_heads = sum(n for name, n in sizes.items() if "qkv" in name) // 6  # 1 KV head of 4 query heads, k and v
    # each rank: its half of its stage's sharded weights; the norms and the replicated KV head whole
    assert sum(per_rank) == whole + norms + 2 * kv_heads
    assert max(per_rank) < 0.3 * whole


def test_prefix_hits_preemption_and_async_scheduling(model_dirs: dict[str, str]) -> None:
    model_dir = model_dirs["llama-gqa2-tied"]
    with pp_llm(model_dir, 2, block_size=16, async_scheduling=True) as llm:
        check_prefix_hits(llm, model_dir)
    # 12 blocks of 8 tokens: max_model_len 96 fits, the batch does not; chunks of 8 tokens
    with pp_llm(model_dir, 2, num_kv_blocks=12, block_size=8, max_model_len=96, kv_cache_memory=None,
                max_num_batched_tokens=8, async_scheduling=True) as llm:
        assert run(llm, PROMPTS, MAX_TOKENS) == expected(model_dir, PROMPTS, MAX_TOKENS)
        assert llm.engine.core.scheduler.num_preemptions > 0


def test_middle_stage() -> None:
    """3 stages over the demo model's 4 layers (vLLM's split: 1, 2, 1): the middle stage receives and
    sends hidden states, takes the tokens it does not sample; the same tokens as one rank (float32, the
    layer loop on both, which the golden tests check against transformers), two steps in flight."""
    demo = str(Path(__file__).resolve().parents[2] / "models" / "tokenmill-demo")
    reqs = random_prompts(8, 8, 120, seed=3, vocab=8192)
    params = [greedy(n) for n in (12, 30, 5, 20, 9, 25, 16, 3)]

    def tokens(llm: LLM) -> list[list[int]]:
        return [o.outputs[0].token_ids for o in llm.generate(reqs, params, use_tqdm=False)]

    one = tokens(LLM(demo, dtype="float32", kv_cache_memory="32MiB"))
    with pp_llm(demo, 3, kv_cache_memory="32MiB", max_num_batched_tokens=64, async_scheduling=True) as llm:
        assert [list(r) for r in llm.engine.core.executor.collective_rpc("stage_layers")] == [[0], [1, 2], [3]]
        assert tokens(llm) == one
