"""Golden tests of the fast structured-output paths in bfloat16, against the reference path (the Python
layer loop and sampler: the bitmask unpacked onto float32 logits, then torch's argmax or the sampling):
the C++ masked argmax (alone and fused with the layer loop), bitmasks filled on the backend's thread
while the forward runs, and async scheduling with a constrained request scheduled before its last token
is in. Mixed batches (greedy and seeded constrained requests, n > 1, a stop string, free requests),
chunked prefill, preemption, prefix-cache hits and draft tokens all give the reference's tokens."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import numpy as np
import pytest
import torch

from tests.fixtures import fused_decode_possible
from tests.spec_decode.test_spec_decode import Garbage, Oracle
from tokenmill import LLM, SamplingParams
from tokenmill.kernels import load_cpu_kernels
from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.worker.sampler import apply_token_bitmask

from .test_engine_structured import PROMPTS, SCHEMA, backend_of


def constrained(seed: int | None = None, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0 if seed is None else 0.8, seed=seed, max_tokens=80,
                          structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True), **kw)


FREE = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
# greedy and seeded constrained requests, n > 1, a stop string, and free requests in one batch
MIXED = [constrained(), constrained(seed=3), constrained(seed=5, n=2), constrained(stop=['"xs"']),
         FREE, constrained(), FREE, constrained(seed=9)]


def make(llama_dir: str, dtype: str = "bfloat16", reference: bool = False, **kw: Any) -> LLM:
    args: dict[str, Any] = {"num_kv_blocks": 64, "block_size": 8, "max_model_len": 128, "async_scheduling": False}
    llm = LLM(llama_dir, dtype=dtype, **{**args, **kw})
    runner = llm.engine.core.executor.runner
    if reference:
        runner.fused_decode = None  # the Python layer loop
        runner.sampler.ops = None  # the torch sampler: the bitmask unpacked, then argmax or sampling
    elif dtype == "bfloat16":
        assert (runner.fused_decode is not None) == fused_decode_possible() and runner.sampler.ops is not None
    return llm


def tokens(outs: list[Any]) -> list[list[int]]:
    return [list(c.token_ids) for o in outs for c in o.outputs]


def twice(llm: LLM) -> tuple[list[Any], list[Any]]:
    """MIXED run cold, then again with the prompts' blocks in the prefix cache."""
    first = llm.generate(PROMPTS * 2, MIXED, use_tqdm=False)
    again = llm.generate(PROMPTS * 2, MIXED, use_tqdm=False)
    assert sum(o.num_cached_tokens for o in again) > 0
    assert not backend_of(llm)._matchers  # every request's matcher freed
    return first, again


@pytest.fixture(scope="module")
def bf16_reference(llama_dir: str) -> tuple[list[Any], list[Any]]:
    first, again = twice(make(llama_dir, reference=True))
    for o, p in zip(first, MIXED, strict=True):
        for c in o.outputs:
            if p.structured_outputs is not None and not p.stop:
                assert c.finish_reason == "stop", c.text
                jsonschema.validate(json.loads(c.text), SCHEMA)
    return first, again


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_fused_masked_argmax_gives_the_reference_tokens(llama_dir: str, async_scheduling: bool,
                                                        bf16_reference: tuple[list[Any], list[Any]]) -> None:
    """bfloat16: the whole decode step in one C++ call with the bitmask (or the forward, then the masked
    argmax where the fill is not in yet), against the Python layer loop and the torch sampler."""
    first, again = twice(make(llama_dir, async_scheduling=async_scheduling))
    assert tokens(first) == tokens(bf16_reference[0])
    assert tokens(again) == tokens(bf16_reference[1])


@pytest.fixture(scope="module")
def f32_reference(llama_dir: str) -> list[list[int]]:
    return tokens(twice(make(llama_dir, dtype="float32"))[0])


@pytest.mark.parametrize("kw", [
    {"async_scheduling": True},
    {"async_scheduling": True, "max_num_batched_tokens": 16},  # prefills in chunks beside the decodes
    {"async_scheduling": True, "num_kv_blocks": 24},  # preemption
    {"max_num_batched_tokens": 16, "num_kv_blocks": 24},
], ids=["async", "async-chunked", "async-preempt", "sync-chunked-preempt"])
def test_scheduling_gives_the_sync_tokens(llama_dir: str, f32_reference: list[list[int]], kw: dict[str, Any]) -> None:
    """float32 (where chunking and recompute keep the numbers): constrained requests scheduled with their
    last token still in flight, their bitmasks filled once it is in, give the tokens of async scheduling off."""
    llm = make(llama_dir, dtype="float32", **kw)
    first, again = twice(llm)
    assert tokens(first) == tokens(again) == f32_reference
    if kw.get("num_kv_blocks"):
        assert llm.engine.core.scheduler.num_preemptions > 0


def test_draft_tokens_give_the_sync_tokens(llama_dir: str) -> None:
    """float32 (a step that verifies drafts computes several rows a request): the bitmask rows of the drafts,
    filled on the backend's thread, give the tokens without drafts, wrong drafts or right ones."""
    llm = make(llama_dir, dtype="float32")
    plain = llm.generate(PROMPTS * 2, MIXED, use_tqdm=False)
    runner = llm.engine.core.executor.runner
    # right drafts where a request's prompt is its own (requests that share a prompt get some wrong ones)
    sequences = [list(o.prompt_token_ids) + list(c.token_ids) for o in plain for c in o.outputs]
    for proposer in (Garbage(3), Oracle(sequences, 4)):
        runner.set_proposer(proposer)
        try:
            got = llm.generate(PROMPTS * 2, MIXED, use_tqdm=False)
        finally:
            runner.set_proposer(None)
        assert tokens(got) == tokens(plain)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_masked_argmax_kernel_equals_the_reference(dtype: torch.dtype) -> None:
    ops = load_cpu_kernels()
    assert ops is not None
    g = torch.Generator().manual_seed(0)
    for vocab in (1, 31, 32, 100, 513, 4099):
        for density in (0.0, 0.02, 0.5, 1.0):
            words = -(-vocab // 32) + 1  # a word past the vocabulary too
            logits = (torch.randn(9, vocab, generator=g) * 3).round().to(dtype)  # many ties
            allowed = torch.rand(9, words * 32, generator=g) < density
            allowed[0] = True  # an unconstrained row
            allowed[1, :] = False
            allowed[1, vocab - 1] = True  # one token allowed: the last
            bits = np.packbits(allowed.numpy().astype(np.uint8), axis=1, bitorder="little").view("<i4")
            bitmask = torch.from_numpy(bits.astype(np.int32))
            ref = logits.float()
            apply_token_bitmask(ref, bitmask)
            got = ops.argmax_rows_masked(logits, bitmask)
            some = torch.isfinite(ref).any(dim=1)  # rows with an allowed token
            assert torch.equal(got[some], ref.argmax(dim=-1)[some]), (vocab, density)
            for r in (~some).nonzero().flatten().tolist():  # none allowed within the vocabulary
                assert got[r] == 0
