"""The structured-output seam in the scheduler: the bitmask layout, which requests are asked for a
bitmask each step (those that sample, with a row per sampled position), and what the manager is told
(the tokens taken, cut at a stop; the requests that finished)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import pytest

from tokenmill.config import CacheConfig, SchedulerConfig
from tokenmill.core.request import Request
from tokenmill.core.scheduler import Scheduler
from tokenmill.core.structured_output import bitmask_words
from tokenmill.structured.bitmask import allowed_ids, pack_allowed

from .test_scheduler import VOCAB, FakeRunner, Result, check_step, make_request, make_scheduler
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

    def grammar_bitmask(self, requests: Sequence[Request], drafts: Mapping[str, list[int]]) -> dict[str, np.ndarray]:
        out = {}
        for req in requests:
            if req.request_id in self.allowed:
                row = pack_allowed(self.allowed[req.request_id], VOCAB)
                out[req.request_id] = np.tile(row, (1 + len(drafts.get(req.request_id, [])), 1))
        self.asked.append({rid: m.shape for rid, m in out.items()})
        return out

    def accept_tokens(self, request: Request, token_ids: list[int]) -> None:
        self.taken.setdefault(request.request_id, []).extend(token_ids)

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


def test_structured_output_needs_sync_scheduling() -> None:
    sched = Scheduler(SchedulerConfig(4, 64, 64, True), CacheConfig(4, 0, 32, True), 32)
    with pytest.raises(ValueError, match="async_scheduling"):
        sched.set_structured_output(AllowList({}))
