"""Structured output end to end: toy grammars installed on the scheduler (an allow-list, and a tiny
state machine kept from the tokens it is told) constrain their requests' every token, greedy and
seeded, in float32 and in bf16 (where the fused greedy decode must step aside), with and without
draft tokens, while the unconstrained requests beside them keep their tokens."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np
import pytest

from tests.conftest import random_prompts
from tests.fixtures import VOCAB, fused_decode_possible
from tests.spec_decode.test_spec_decode import Garbage, Oracle
from tokenmill import LLM, SamplingParams
from tokenmill.core.request import Request
from tokenmill.structured.bitmask import pack_allowed

PROMPTS = random_prompts(6, 4, 30, seed=50)
ALLOWED = sorted(random_prompts(1, 12, 12, seed=51)[0])  # what request 0 may say
ALLOW, PARITY = 0, 1  # constrained prompts; the others are free


class ToyGrammar:
    """Prompt ALLOW may say only ALLOWED; prompt PARITY must alternate even and odd tokens, even first,
    the state advanced by the tokens the scheduler reports (and checked against the request's own)."""

    def __init__(self) -> None:
        self.allow = pack_allowed(ALLOWED, VOCAB)
        self.parity = [pack_allowed(range(p, VOCAB, 2), VOCAB) for p in (0, 1)]
        self.next_parity: dict[str, int] = {}
        self.told: dict[str, int] = {}  # tokens reported per request
        self.freed: list[str] = []

    follows_tokens_in_flight = False

    def is_ready(self, request: Request) -> bool:
        return True

    def grammar_bitmask(self, requests: Sequence[Request], drafts: Mapping[str, list[int]]) -> dict[str, np.ndarray]:
        out = {}
        for req in requests:
            rows = 1 + len(drafts.get(req.request_id, []))
            if req.prompt_token_ids == PROMPTS[ALLOW]:
                out[req.request_id] = np.tile(self.allow, (rows, 1))
            elif req.prompt_token_ids == PROMPTS[PARITY]:
                assert self.told.get(req.request_id, 0) == req.num_output_tokens
                p = self.next_parity.setdefault(req.request_id, 0)
                # row j: after j drafts, as if taken (a draft of the wrong parity is rejected there)
                out[req.request_id] = np.stack([self.parity[(p + j) % 2] for j in range(rows)])
        return out

    def accept_tokens(self, request: Request, token_ids: list[int]) -> bool:
        self.told[request.request_id] = self.told.get(request.request_id, 0) + len(token_ids)
        if request.request_id in self.next_parity:
            for tok in token_ids:
                assert tok % 2 == self.next_parity[request.request_id]
                self.next_parity[request.request_id] ^= 1
        return False

    def free(self, request_id: str) -> None:
        self.freed.append(request_id)


def params(seeded: bool) -> list[SamplingParams]:
    if seeded:
        return [SamplingParams(temperature=1.0, seed=60 + i, max_tokens=16, ignore_eos=True) for i in range(6)]
    return [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True) for _ in range(6)]


def tokens(llm: LLM, seeded: bool) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params(seeded), use_tqdm=False)]


def check(free: list[list[int]], constrained: list[list[int]]) -> None:
    assert set(constrained[ALLOW]) <= set(ALLOWED) and len(constrained[ALLOW]) == 16
    assert [t % 2 for t in constrained[PARITY]] == [0, 1] * 8
    assert constrained[ALLOW] != free[ALLOW] and constrained[PARITY] != free[PARITY]  # the grammar did something
    assert constrained[2:] == free[2:]


def grammar_run(llm: LLM, seeded: bool, proposer: Any = None,
                grammar: ToyGrammar | None = None) -> tuple[list[list[int]], ToyGrammar]:
    grammar = grammar or ToyGrammar()
    backend = llm.engine.core.scheduler.structured_output
    llm.engine.core.scheduler.set_structured_output(grammar)
    llm.engine.core.executor.runner.set_proposer(proposer)
    try:
        return tokens(llm, seeded), grammar
    finally:
        llm.engine.core.scheduler.set_structured_output(backend)
        llm.engine.core.executor.runner.set_proposer(None)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_constrained_requests_obey_and_the_others_keep_their_tokens(llama_dir: str, dtype: str,
                                                                    seeded: bool) -> None:
    llm = LLM(llama_dir, dtype=dtype, kv_cache_memory="8MiB", async_scheduling=False)
    if dtype == "bfloat16":  # the fused greedy decode would take these steps without the bitmask
        assert (llm.engine.core.executor.runner.fused_decode is not None) == fused_decode_possible()
    free = tokens(llm, seeded)
    constrained, grammar = grammar_run(llm, seeded)
    check(free, constrained)
    assert sorted(grammar.freed) == sorted(grammar.told) and len(grammar.told) == 6


class LateGrammar(ToyGrammar):
    """ToyGrammar's bitmasks, given 5 ms after the step asks, from another thread (as a fill that waits for the
    tokens of the step in flight under async scheduling)."""

    def grammar_bitmask(self, requests: Sequence[Request],
                        drafts: Mapping[str, list[int]]) -> Future[dict[str, np.ndarray]]:
        rows = super().grammar_bitmask(requests, drafts)
        future: Future[dict[str, np.ndarray]] = Future()
        threading.Timer(0.005, future.set_result, (rows,)).start()
        return future


def test_bitmasks_filled_late_are_waited_for_inside_the_fused_call(llama_dir: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # a step whose bitmasks are still being filled when it begins runs in one decode_greedy call, which waits for
    # them after its lm_head: the same tokens as a step whose bitmasks were in at its start
    # bf16 where oneDNN packs it; float32 on an AVX2-only CPU, whose fused path takes float32 models
    dtype = "bfloat16" if fused_decode_possible() else "float32"
    llm = LLM(llama_dir, dtype=dtype, kv_cache_memory="8MiB", async_scheduling=False)
    fused = llm.engine.core.executor.runner.fused_decode
    if fused is None:
        pytest.skip(f"no fused decode step for a {dtype} model on this CPU")
    free = tokens(llm, False)
    ready, _ = grammar_run(llm, False)
    calls = {"lm_head_greedy": 0, "decode_greedy": 0, "release_flag": 0}
    ops = fused.ops

    class Counting:
        def __getattr__(self, name: str) -> Any:
            if name in calls:
                calls[name] += 1
            return getattr(ops, name)

    monkeypatch.setattr(fused, "ops", Counting())
    late, _ = grammar_run(llm, False, grammar=LateGrammar())
    check(free, late)
    assert late == ready
    assert calls["decode_greedy"] > 0 and calls["release_flag"] > 0 and calls["lm_head_greedy"] == 0, calls


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_bitmasks_with_draft_tokens(llama_dir: str, seeded: bool) -> None:
    llm = LLM(llama_dir, dtype="float32", kv_cache_memory="8MiB", async_scheduling=False)
    free = tokens(llm, seeded)
    constrained, _ = grammar_run(llm, seeded)
    check(free, constrained)
    # wrong drafts (most break the grammar too): the same tokens
    assert grammar_run(llm, seeded, Garbage(3))[0] == constrained
    # the constrained run's own continuation as drafts: the same tokens, fewer steps
    sched = llm.engine.core.scheduler
    before = sched.num_steps
    grammar_run(llm, seeded)
    plain_steps, before = sched.num_steps - before, sched.num_steps
    oracle = Oracle([p + t for p, t in zip(PROMPTS, constrained, strict=True)], 4)
    assert grammar_run(llm, seeded, oracle)[0] == constrained
    assert sched.num_steps - before < plain_steps
