"""The structured-output seam in the scheduler: the bitmask layout, which requests are asked for a
bitmask each step (those that sample, with a row per sampled position), and what the manager is told
(the tokens taken, cut at a stop; the requests that finished)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from tokenmill.core.messages import EngineCoreRequest
from tokenmill.core.request import Request
from tokenmill.core.structured_output import bitmask_words
from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams
from tokenmill.structured.bitmask import allowed_ids, pack_allowed

from .test_scheduler import (
    EOS,
    VOCAB,
    FakeRunner,
    Result,
    assert_all_free,
    check_step,
    make_request,
    make_scheduler,
    step,
)
from .test_spec_scheduling import partly_right


def test_bitmask_layout_is_xgrammars() -> None:
    allowed = [0, 5, 31, 32, 63, 64, 99]
    mask = pack_allowed(allowed, 100)
    assert mask.dtype == np.int32 and mask.shape == (bitmask_words(100),) == (4,)
    for t in range(128):  # token t: bit t % 32 of word t // 32
        assert bool((int(mask[t // 32]) >> (t % 32)) & 1) == (t in allowed), t
    assert allowed_ids(mask).tolist() == allowed


class AllowList:
    """A toy grammar: each constrained request may say only the tokens of its set. Records what it is asked."""

    def __init__(self, allowed: dict[str, set[int]]) -> None:
        self.allowed = allowed
        self.asked: list[dict[str, tuple[int, ...]]] = []  # per step: request id -> bitmask shape
        self.taken: dict[str, list[int]] = {}
        self.freed: list[str] = []

    follows_tokens_in_flight = False

    def is_ready(self, request: Request) -> bool:
        return True

    def grammar_bitmask(self, requests: Sequence[Request], drafts: Mapping[str, list[int]]) -> dict[str, np.ndarray]:
        out = {}
        for req in requests:
            if req.request_id in self.allowed:
                row = pack_allowed(self.allowed[req.request_id], VOCAB)
                out[req.request_id] = np.tile(row, (1 + len(drafts.get(req.request_id, [])), 1))
        self.asked.append({rid: m.shape for rid, m in out.items()})
        return out

    def accept_tokens(self, request: Request, token_ids: list[int]) -> bool:
        self.taken.setdefault(request.request_id, []).extend(token_ids)
        return False

    def free(self, request_id: str) -> None:
        self.freed.append(request_id)


def test_bitmasks_are_asked_for_the_requests_that_sample_one_row_a_position() -> None:
    sched = make_scheduler(budget=12)
    grammar = AllowList({"a": {7, 8}, "c": {9}})
    sched.set_structured_output(grammar)
    runner = FakeRunner(4, propose=partly_right(3))
    sched.add_request(make_request("a", [5] * 6, 0.0, max_tokens=9))
    sched.add_request(make_request("b", [6] * 4, 1.0, max_tokens=12))
    sched.add_request(make_request("c", [4] * 30, 2.0, max_tokens=5))  # prefilled in chunks
    results: dict[str, Result] = {}
    with_drafts = 0
    while sched.has_unfinished_requests():
        so = sched.schedule()
        check_step(sched, so)
        out = runner.execute(so)
        sampling = {rid for rid, toks in zip(out.req_ids, out.sampled_token_ids) if toks}
        assert set(so.grammar_bitmask) == sampling & {"a", "c"}
        for rid, mask in so.grammar_bitmask.items():
            assert mask.shape == (1 + len(so.scheduled_spec_decode_tokens.get(rid, [])), bitmask_words(VOCAB))
            with_drafts += mask.shape[0] > 1
        for o in sched.update_from_output(so, out):
            results.setdefault(o.request_id, Result()).token_ids.extend(o.new_token_ids)
    assert with_drafts  # some steps asked for the drafts' positions too
    assert grammar.taken == {rid: r.token_ids for rid, r in results.items()}  # all of them, once, in order
    assert sorted(grammar.freed) == ["a", "b", "c"]


class Compiling(AllowList):
    """Grammars that take a while: request r is ready after ready_after[r] questions; those in `broken` fail;
    `ends_after[r]` tokens complete r's grammar."""

    def __init__(self, ready_after: dict[str, int], broken: set[str], ends_after: dict[str, int]) -> None:
        super().__init__({rid: set(range(VOCAB)) for rid in ready_after})
        self.ready_after, self.broken, self.ends_after = dict(ready_after), broken, ends_after

    def is_ready(self, request: Request) -> bool:
        rid = request.request_id
        if rid in self.broken:
            raise ValueError(f"structured output: invalid grammar for {rid}")
        self.ready_after[rid] = self.ready_after.get(rid, 0) - 1
        return self.ready_after[rid] < 0

    def accept_tokens(self, request: Request, token_ids: list[int]) -> bool:
        super().accept_tokens(request, token_ids)
        return len(self.taken[request.request_id]) >= self.ends_after.get(request.request_id, 1 << 30)


def test_a_request_waits_for_its_grammar_without_holding_up_the_others() -> None:
    sched = make_scheduler(max_num_seqs=4)
    grammar = Compiling({"slow": 5, "fast": 0}, {"bad"}, {"fast": 3})
    sched.set_structured_output(grammar)
    for i, rid in enumerate(["slow", "bad", "free", "fast"]):
        sched.add_request(make_request(rid, [5 + i] * 6, float(i), max_tokens=8, ignore_eos=True))
    runner, results = FakeRunner(4), {}
    first_step: dict[str, int] = {}
    for k in range(40):
        if not sched.has_unfinished_requests():
            break
        so = step(sched, runner, results)
        for rid in so.num_scheduled_tokens:
            first_step.setdefault(rid, k)
    assert first_step["free"] == first_step["fast"] == 0 < first_step["slow"]  # queued first, scheduled later
    assert results["bad"].finish_reason == "error" and "invalid grammar" in str(results["bad"].stop_reason)
    assert "bad" not in first_step and not results["bad"].token_ids
    assert (results["fast"].finish_reason, len(results["fast"].token_ids)) == ("stop", 3)  # the grammar ended it
    assert results["slow"].finish_reason == results["free"].finish_reason == "length"
    assert len(results["slow"].token_ids) == 8 and grammar.taken["slow"] == results["slow"].token_ids
    assert_all_free(sched)


class TokensFirst(AllowList):
    """Checks that each bitmask is asked for after all the request's earlier tokens were told."""

    def grammar_bitmask(self, requests: Sequence[Request], drafts: Mapping[str, list[int]]) -> dict[str, np.ndarray]:
        for req in requests:
            if req.request_id in self.allowed:
                assert len(self.taken.get(req.request_id, [])) == req.num_output_tokens
                assert req.num_output_placeholders == 1  # only the token this step samples is in flight
        return super().grammar_bitmask(requests, drafts)


def test_with_async_scheduling_a_constrained_request_waits_for_its_last_token() -> None:
    from .test_async_scheduling import collect, make_core

    core, executor = make_core(64, 4, 64, 4, 64)
    grammar = TokensFirst({"a": set(range(VOCAB))})
    core.scheduler.set_structured_output(grammar)
    constrained = SamplingParams(max_tokens=10, ignore_eos=True, structured_outputs=StructuredOutputsParams(regex=".*"))
    core.add_request(EngineCoreRequest("a", [3, 4, 5], constrained, (EOS,), 0.0))
    core.add_request(EngineCoreRequest("b", [3, 4, 5], SamplingParams(max_tokens=10, ignore_eos=True), (EOS,), 0.0))
    results: dict[str, Result] = {}
    while core.has_unfinished_requests():
        collect(results, core.step().outputs)
    assert executor.max_queued == 2  # the steps did overlap
    assert len(results["a"].token_ids) == len(results["b"].token_ids) == 10
    assert grammar.taken["a"] == results["a"].token_ids
