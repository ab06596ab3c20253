"""The scheduler with a fake, pure-Python model runner (no torch).

The fake runner keeps the worker's side of the contract as the real one does (request
states, block tables, resumes), and a shadow KV memory: every computed position writes
(position, token) into its slot, and every step first reads back all earlier positions
through the block table. A wrong block table, a bad prefix hit or a block reused while
another request still needs it therefore fails the step that reads it. Its "model" is a
hash of the whole sequence, so the right outputs are known without running anything.
"""

from __future__ import annotations

import zlib
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from tokenmill.config import CacheConfig, SchedulerConfig
from tokenmill.core.block_pool import BlockPool
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.sched_output import ModelRunnerOutput, SchedulerOutput
from tokenmill.core.scheduler import Scheduler
from tokenmill.sampling_params import SamplingParams

EOS = 0
VOCAB = 1000


def hash_model(tokens: Sequence[int]) -> int:
    """The next token as a function of the whole sequence; never EOS."""
    return 2 + zlib.crc32(array("q", tokens).tobytes()) % (VOCAB - 2)


@dataclass
class WorkerState:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int  # run so far
    scheduled_through: int = 0  # prepared so far (ahead of num_computed_tokens with a step in flight)
    samples_in_flight: int = 0  # prepared steps not run yet that sample a token for this request
    reserved: int = 0  # the most tokens given slots since it (re)started: rejected drafts keep theirs


Proposer = Callable[[str, list[int]], list[int]]  # (request id, its tokens) -> draft tokens to follow


@dataclass
class PreparedStep:
    so: SchedulerOutput
    rows: list[tuple[str, WorkerState, int, int, list[int]]]  # (request id, state, start, n, drafts)


class FakeRunner:
    """execute() = run(prepare()); the async engine core prepares a step while the one before it
    has not run yet, as the real runner's prepare/execute do. Draft tokens are verified greedily
    against the model (accepted while they are its next token) and `propose` makes new ones."""

    def __init__(self, block_size: int, next_token: Callable[[str, list[int]], int] | None = None,
                 propose: Proposer | None = None) -> None:
        self.block_size = block_size
        self.next_token = next_token or (lambda rid, tokens: hash_model(tokens))
        self.propose = propose
        self.states: dict[str, WorkerState] = {}
        self.memory: dict[tuple[int, int], tuple[int, int]] = {}  # (block, offset) -> (position, token)
        self.outputs: list[SchedulerOutput] = []
        self.pool: BlockPool | None = None  # when set: a step never writes into a block another table holds

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.run(self.prepare(so))

    def prepare(self, so: SchedulerOutput) -> PreparedStep:
        self.outputs.append(so)
        for rid in so.finished_req_ids:
            assert rid in self.states, f"finished {rid} was never sent to the worker"
            del self.states[rid]
        for new in so.scheduled_new_reqs:
            assert new.req_id not in self.states
            self.states[new.req_id] = WorkerState(list(new.prompt_token_ids), list(new.block_ids),
                                                  new.num_computed_tokens, new.num_computed_tokens)
        for cached in so.scheduled_cached_reqs:
            st_ = self.states[cached.req_id]
            if cached.resumed_from_preemption:
                st_.block_ids = list(cached.new_block_ids)
                st_.reserved = 0
            else:
                assert st_.scheduled_through == cached.num_computed_tokens
                st_.block_ids.extend(cached.new_block_ids)
            st_.scheduled_through = cached.num_computed_tokens
        scheduled = set(so.num_scheduled_tokens)
        assert {r.req_id for r in so.scheduled_new_reqs} <= scheduled
        assert {r.req_id for r in so.scheduled_cached_reqs} <= scheduled
        assert set(so.scheduled_spec_decode_tokens) <= scheduled
        rows = []
        for rid, n in so.num_scheduled_tokens.items():
            st_ = self.states[rid]
            start = st_.scheduled_through
            drafts = so.scheduled_spec_decode_tokens.get(rid, [])
            end = start + n - len(drafts)  # of the request's own tokens
            # the only input not known yet is the token the step in flight samples for this request
            assert end <= len(st_.token_ids) + st_.samples_in_flight and st_.samples_in_flight <= 1
            assert not drafts or (end == len(st_.token_ids) and not st_.samples_in_flight), "drafts not last"
            st_.reserved = max(st_.reserved, start + n)
            assert len(st_.block_ids) == -(-st_.reserved // self.block_size), "block table not tight"
            if end >= len(st_.token_ids) + st_.samples_in_flight:
                st_.samples_in_flight += 1
            st_.scheduled_through = start + n
            rows.append((rid, st_, start, n, drafts))
        return PreparedStep(so, rows)

    def run(self, step: PreparedStep) -> ModelRunnerOutput:
        for src, dst in step.so.blocks_to_copy:  # copy-on-write, before the step's writes
            for o in range(self.block_size):
                slot = self.memory.get((src, o))
                if slot is None:
                    self.memory.pop((dst, o), None)
                else:
                    self.memory[(dst, o)] = slot
        out = ModelRunnerOutput([], [])
        for rid, st_, start, n, drafts in step.rows:
            out.req_ids.append(rid)
            out.sampled_token_ids.append(self._run(rid, st_, start, n, drafts))
            if out.sampled_token_ids[-1] and self.propose is not None:
                out.spec_token_ids[rid] = self.propose(rid, list(st_.token_ids))
        return out

    def _slot(self, st_: WorkerState, p: int) -> tuple[int, int]:
        return st_.block_ids[p // self.block_size], p % self.block_size

    def _run(self, rid: str, st_: WorkerState, start: int, n: int, drafts: list[int]) -> list[int]:
        end = start + n - len(drafts)
        assert n >= 1 and end <= len(st_.token_ids)
        for p in range(start):  # attention reads the whole context
            assert self.memory.get(self._slot(st_, p)) == (p, st_.token_ids[p]), (rid, p)
        inputs = st_.token_ids[start:end] + drafts
        for p in range(start, start + n):
            block, offset = self._slot(st_, p)
            assert self.pool is None or self.pool.blocks[block].ref_cnt == 1, f"{rid} writes a shared block {block}"
            self.memory[block, offset] = (p, inputs[p - start])
        st_.num_computed_tokens = start + n
        if end < len(st_.token_ids):
            return []  # a prefill chunk short of the end samples nothing
        st_.samples_in_flight -= 1
        taken: list[int] = []
        for j in range(len(drafts) + 1):  # verify: accept each draft that is the model's next token
            taken.append(self.next_token(rid, st_.token_ids + taken))
            if j == len(drafts) or taken[-1] != drafts[j]:
                break
        rejected = len(drafts) + 1 - len(taken)
        st_.num_computed_tokens -= rejected
        st_.scheduled_through -= rejected
        st_.token_ids.extend(taken)
        return taken


@dataclass
class Result:
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0


def make_scheduler(num_blocks: int = 64, block_size: int = 4, budget: int = 64, max_num_seqs: int = 8,
                   max_model_len: int = 64, prefix_caching: bool = True, lower_share: int | None = None) -> Scheduler:
    # lower_share: the lower priority classes' tokens a step beside a higher class (default: the whole budget)
    return Scheduler(SchedulerConfig(max_num_seqs, budget, max_model_len,
                                     lower_class_step_tokens=budget if lower_share is None else lower_share),
                     CacheConfig(block_size, 0, num_blocks, prefix_caching), num_blocks)


def make_request(rid: str, prompt: list[int], arrival: float, priority: int = 0, **params: object) -> Request:
    params.setdefault("max_tokens", 8)
    return Request(rid, prompt, SamplingParams(**params), (EOS,), arrival, priority)  # type: ignore[arg-type]


def check_step(sched: Scheduler, so: SchedulerOutput) -> None:
    assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
    assert so.total_num_scheduled_tokens <= sched.config.max_num_batched_tokens
    assert len(so.num_scheduled_tokens) <= sched.config.max_num_seqs
    assert len(sched.running) <= sched.config.max_num_seqs
    assert all(n >= 1 for n in so.num_scheduled_tokens.values())


def step(sched: Scheduler, runner: FakeRunner, results: dict[str, Result]) -> SchedulerOutput:
    so = sched.schedule()
    check_step(sched, so)
    for out in sched.update_from_output(so, runner.execute(so)):
        res = results.setdefault(out.request_id, Result())
        assert res.finish_reason is None, f"output for {out.request_id} after it finished"
        res.token_ids.extend(out.new_token_ids)
        res.finish_reason, res.stop_reason = out.finish_reason, out.stop_reason
        res.num_cached_tokens = out.num_cached_tokens
    return so


def drive(sched: Scheduler, runner: FakeRunner, results: dict[str, Result] | None = None,
          max_steps: int = 5000) -> dict[str, Result]:
    results = {} if results is None else results
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return results
        step(sched, runner, results)
    raise AssertionError("the scheduler made no progress")


def assert_all_free(sched: Scheduler) -> None:
    assert not sched.requests and not sched.running and not sched.waiting
    assert sched.kv.num_free_blocks == sched.kv.pool.num_blocks
    assert all(b.ref_cnt == 0 for b in sched.kv.pool.blocks)
    assert not sched.kv.req_blocks


def reference(prompt: list[int], max_tokens: int, max_model_len: int) -> list[int]:
    tokens, out = list(prompt), []
    while True:
        tok = hash_model(tokens)
        tokens.append(tok)
        out.append(tok)
        if len(out) >= max_tokens or len(tokens) >= max_model_len:
            return out


# ---- budgets ---------------------------------------------------------------------------------
def test_token_budget_and_max_num_seqs_are_respected() -> None:
    sched = make_scheduler(budget=32, max_num_seqs=4)
    runner = FakeRunner(4)
    prompts = [[10 + i] * (10 + 5 * i) for i in range(10)]
    for i, prompt in enumerate(prompts):
        sched.add_request(make_request(f"r{i}", prompt, float(i), max_tokens=6))
    totals, widths = [], []
    results: dict[str, Result] = {}
    while sched.has_unfinished_requests():
        so = step(sched, runner, results)
        totals.append(so.total_num_scheduled_tokens)
        widths.append(len(so.num_scheduled_tokens))
    assert max(totals) == 32 and max(widths) == 4  # both limits were reached, never passed
    for i, prompt in enumerate(prompts):
        assert results[f"r{i}"].token_ids == reference(prompt, 6, 64)
        assert results[f"r{i}"].finish_reason == "length"
    assert_all_free(sched)


def test_chunked_prefill_progression() -> None:
    sched = make_scheduler(budget=16, block_size=4)
    runner = FakeRunner(4)
    prompt = list(range(2, 52))  # 50 tokens
    sched.add_request(make_request("a", prompt, 0.0, max_tokens=3))
    results: dict[str, Result] = {}
    sizes, computed, sampled = [], [], []
    while sched.has_unfinished_requests():
        so = step(sched, runner, results)
        sizes.append(so.num_scheduled_tokens["a"])
        computed.append(runner.states["a"].num_computed_tokens)
        sampled.append(len(results.get("a", Result()).token_ids))
    assert sizes == [16, 16, 16, 2, 1, 1]
    assert computed == [16, 32, 48, 50, 51, 52]
    assert sampled == [0, 0, 0, 1, 2, 3]  # nothing sampled before the prefill is complete
    first, *rest = runner.outputs
    assert first.scheduled_new_reqs[0].num_computed_tokens == 0
    assert [so.scheduled_cached_reqs[0].num_computed_tokens for so in rest] == [16, 32, 48, 50, 51]
    assert results["a"].token_ids == reference(prompt, 3, 64)


def test_decodes_go_first_and_prefill_takes_the_rest_of_the_budget() -> None:
    sched = make_scheduler(budget=16)
    runner = FakeRunner(4)
    sched.add_request(make_request("a", [5, 6, 7], 0.0, max_tokens=10))
    results: dict[str, Result] = {}
    step(sched, runner, results)
    sched.add_request(make_request("b", list(range(2, 42)), 1.0, max_tokens=2))
    so = step(sched, runner, results)
    assert so.num_scheduled_tokens == {"a": 1, "b": 15}
    drive(sched, runner, results)
    assert results["b"].token_ids == reference(list(range(2, 42)), 2, 64)


# ---- preemption ------------------------------------------------------------------------------
def test_preemption_newest_first_requeued_at_front_and_resumed() -> None:
    # 6 blocks of 4 tokens, full after the first step; r0 (the oldest) is the first to need
    # another block, and the newest running request, r2, must make room for it
    sched = make_scheduler(num_blocks=6, block_size=4, budget=64, max_num_seqs=3, max_model_len=24)
    runner = FakeRunner(4)
    prompts = {f"r{i}": [20 + i] * (8 if i == 0 else 7) for i in range(3)}
    for i, (rid, prompt) in enumerate(prompts.items()):
        sched.add_request(make_request(rid, prompt, float(i), max_tokens=12))
    results: dict[str, Result] = {}
    step(sched, runner, results)
    assert sched.kv.num_free_blocks == 0 and sched.num_preemptions == 0
    prompts["urgent"] = [30] * 7  # waits (max_num_seqs), ahead of all but preempted requests
    sched.add_request(make_request("urgent", prompts["urgent"], 3.0, priority=-1, max_tokens=12))
    so = step(sched, runner, results)
    assert sched.num_preemptions == 1 and so.num_scheduled_tokens == {"r0": 1, "r1": 1}
    assert [r.request_id for r in sched.waiting] == ["r2", "urgent"]
    assert sched.waiting[0].status == RequestStatus.PREEMPTED and sched.waiting[0].num_computed_tokens == 0
    preempted = ["r2"]
    while sched.has_unfinished_requests():
        running_before = list(sched.running)
        so = step(sched, runner, results)
        victims = [r for r in running_before if r.status == RequestStatus.PREEMPTED]
        preempted += [r.request_id for r in victims]
        if victims:  # the newest of the running requests this step did not schedule go first
            unscheduled = [r for r in running_before if r.request_id not in so.num_scheduled_tokens]
            assert max(r.arrival_time for r in victims) == max(r.arrival_time for r in unscheduled)
            statuses = [r.status for r in sched.waiting]  # requeued ahead of all that never ran
            assert statuses == sorted(statuses, key=lambda s: s != RequestStatus.PREEMPTED)
    assert sched.num_preemptions == len(preempted)
    resumed = [c for so in runner.outputs for c in so.scheduled_cached_reqs if c.resumed_from_preemption]
    assert sorted({c.req_id for c in resumed}) == sorted(set(preempted))
    for rid, prompt in prompts.items():  # outputs from before and after preemption join up exactly
        assert results[rid].token_ids == reference(prompt, 12, 24), rid
    assert_all_free(sched)


def test_resumed_request_gets_its_whole_block_table() -> None:
    sched = make_scheduler(num_blocks=8, block_size=4, budget=64, max_num_seqs=2, max_model_len=32)
    runner = FakeRunner(4)
    sched.add_request(make_request("old", [3] * 8, 0.0, max_tokens=20))
    sched.add_request(make_request("new", [4] * 8, 1.0, max_tokens=20))
    results = drive(sched, runner)
    resumed = [(so, c) for so in runner.outputs for c in so.scheduled_cached_reqs if c.resumed_from_preemption]
    assert resumed and all(c.req_id == "new" for _, c in resumed)
    for so, c in resumed:
        n = so.num_scheduled_tokens[c.req_id]
        assert len(c.new_block_ids) == -(-(c.num_computed_tokens + n) // 4)
    for rid, prompt in (("old", [3] * 8), ("new", [4] * 8)):
        assert results[rid].token_ids == reference(prompt, 20, 32)
    assert_all_free(sched)


def test_preemption_takes_the_lowest_priority_first() -> None:
    sched = make_scheduler(num_blocks=8, block_size=4, budget=64, max_num_seqs=2, max_model_len=32)
    runner = FakeRunner(4)
    sched.add_request(make_request("low", [3] * 8, 0.0, priority=5, max_tokens=20))
    sched.add_request(make_request("high", [4] * 8, 1.0, priority=0, max_tokens=20))
    results: dict[str, Result] = {}
    first_victim = None
    while sched.has_unfinished_requests() and first_victim is None:
        step(sched, runner, results)
        first_victim = next((r.request_id for r in sched.waiting if r.status == RequestStatus.PREEMPTED), None)
    assert first_victim == "low"
    drive(sched, runner, results)
    assert results["high"].token_ids == reference([4] * 8, 20, 32)
    assert results["low"].token_ids == reference([3] * 8, 20, 32)


# ---- abort, priority -------------------------------------------------------------------------
def test_abort_frees_blocks_of_running_and_waiting_requests() -> None:
    sched = make_scheduler(num_blocks=16, block_size=4, max_num_seqs=2)
    runner = FakeRunner(4)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", [7 + i] * 10, float(i), max_tokens=30))
    results: dict[str, Result] = {}
    step(sched, runner, results)
    assert [r.request_id for r in sched.running] == ["r0", "r1"] and sched.waiting[0].request_id == "r2"
    free_before = sched.kv.num_free_blocks
    outs = sched.abort_requests(["r0", "r2", "nope"])
    assert [(o.request_id, o.finish_reason) for o in outs] == [("r0", "abort"), ("r2", "abort")]
    assert sched.kv.num_free_blocks == free_before + 3  # the 3 blocks of r0's 10 tokens; r2 had none
    assert sched.abort_requests(["r0"]) == []
    so = step(sched, runner, results)
    assert so.finished_req_ids == {"r0"}  # r2 never reached the worker
    assert "r0" not in runner.states and "r0" not in so.num_scheduled_tokens
    assert [r.request_id for r in sched.running] == ["r1"]
    sched.abort_requests(["r1"])
    assert_all_free(sched)
    assert sched.schedule().finished_req_ids == {"r1"}


def test_priority_then_arrival_order() -> None:
    sched = make_scheduler(max_num_seqs=1)
    runner = FakeRunner(4)
    for rid, priority, arrival in (("p3", 3, 0.0), ("p1a", 1, 1.0), ("p2", 2, 2.0), ("p1b", 1, 3.0)):
        sched.add_request(make_request(rid, [5, 6], arrival, priority=priority, max_tokens=2))
    drive(sched, runner)
    order = [new.req_id for so in runner.outputs for new in so.scheduled_new_reqs]
    assert order == ["p1a", "p1b", "p2", "p3"]


# ---- stopping --------------------------------------------------------------------------------
def scripted(script: dict[str, list[int]]) -> Callable[[str, list[int]], int]:
    counters: dict[str, int] = {}

    def next_token(rid: str, tokens: list[int]) -> int:
        i = counters.get(rid, 0)
        counters[rid] = i + 1
        return script[rid][i]

    return next_token


@pytest.mark.parametrize(
    ("params", "script", "tokens", "reason", "stop_reason"),
    [
        ({}, [5, 6, EOS, 7], [5, 6, EOS], "stop", None),
        ({"ignore_eos": True, "max_tokens": 4}, [5, EOS, 6, EOS, 9], [5, EOS, 6, EOS], "length", None),
        ({"stop_token_ids": [6]}, [5, 6, 7], [5, 6], "stop", 6),
        ({"max_tokens": 2}, [5, 6, 7], [5, 6], "length", None),
        ({"min_tokens": 4}, [EOS, 6, EOS, 5, EOS, 9], [EOS, 6, EOS, 5, EOS], "stop", None),
        ({"min_tokens": 3, "stop_token_ids": [6]}, [6, 6, 5, 6, 9], [6, 6, 5, 6], "stop", 6),
    ],
    ids=["eos", "ignore_eos", "stop_token_ids", "max_tokens", "min_tokens_eos", "min_tokens_stop_ids"],
)
def test_stop_conditions(params: dict[str, object], script: list[int], tokens: list[int], reason: str,
                         stop_reason: int | None) -> None:
    sched = make_scheduler()
    runner = FakeRunner(4, scripted({"a": script}))
    sched.add_request(make_request("a", [9, 9, 9], 0.0, **{"max_tokens": 10, **params}))
    results = drive(sched, runner)
    assert results["a"].token_ids == tokens
    assert (results["a"].finish_reason, results["a"].stop_reason) == (reason, stop_reason)
    assert_all_free(sched)


def test_max_model_len_stops_with_length() -> None:
    sched = make_scheduler(max_model_len=14)
    runner = FakeRunner(4)
    sched.add_request(make_request("a", list(range(2, 12)), 0.0, max_tokens=50))
    results = drive(sched, runner)
    assert results["a"].token_ids == reference(list(range(2, 12)), 50, 14)
    assert len(results["a"].token_ids) == 4 and results["a"].finish_reason == "length"
    assert max(len(s.token_ids) for s in runner.states.values()) <= 14


# ---- prefix caching --------------------------------------------------------------------------
def test_prefix_cache_hits_are_counted_and_skip_compute() -> None:
    sched = make_scheduler(block_size=4)
    runner = FakeRunner(4)
    prompt = list(range(2, 12))  # 10 tokens: 2 full blocks can be reused, the last token is recomputed
    sched.add_request(make_request("a", prompt, 0.0, max_tokens=1))
    first = drive(sched, runner)
    assert first["a"].num_cached_tokens == 0
    sched.add_request(make_request("b", prompt + [50], 1.0, max_tokens=1))
    so = sched.schedule()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 8 and so.num_scheduled_tokens == {"b": 3}
    (out,) = sched.update_from_output(so, runner.execute(so))
    assert out.num_cached_tokens == 8
    stats = sched.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (10 + 11, 8)
    assert_all_free(sched)


def test_prefix_cache_counts_a_waiting_request_once() -> None:
    # r0 fills most of the pool, so r1 waits several steps before it is admitted
    sched = make_scheduler(num_blocks=8, block_size=4, max_model_len=32)
    runner = FakeRunner(4)
    sched.add_request(make_request("r0", [3] * 20, 0.0, max_tokens=8))
    sched.add_request(make_request("r1", [4] * 16, 1.0, max_tokens=2))
    results: dict[str, Result] = {}
    waited = 0
    while sched.has_unfinished_requests():
        step(sched, runner, results)
        waited += any(r.request_id == "r1" for r in sched.waiting)
    assert waited > 1
    stats = sched.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (20 + 16, 0)


def test_no_prefix_hits_without_prefix_caching() -> None:
    sched = make_scheduler(prefix_caching=False)
    runner = FakeRunner(4)
    sched.add_request(make_request("a", list(range(2, 12)), 0.0, max_tokens=1))
    drive(sched, runner)
    sched.add_request(make_request("b", list(range(2, 12)), 1.0, max_tokens=1))
    results = drive(sched, runner)
    assert results["b"].num_cached_tokens == 0 and sched.stats().prefix_cache_hits == 0


# ---- everything at once ----------------------------------------------------------------------
STEMS = [[11] * 12, list(range(30, 42)), [11] * 4 + [12] * 8]


@st.composite
def workloads(draw: st.DrawFn) -> tuple[dict[str, int], list[tuple[int, list[int], int, int]]]:
    block_size = draw(st.sampled_from([2, 4]))
    max_model_len = 24
    cfg = dict(block_size=block_size, max_model_len=max_model_len,
               num_blocks=draw(st.integers(max_model_len // block_size, max_model_len // block_size + 6)),
               budget=draw(st.integers(1, 40)), max_num_seqs=draw(st.integers(1, 5)))
    reqs = []
    for _ in range(draw(st.integers(1, 8))):
        stem = draw(st.sampled_from(STEMS))[:draw(st.integers(0, 12))]
        prompt = (stem + draw(st.lists(st.integers(50, 53), max_size=8)))[:max_model_len - 1] or [7]
        reqs.append((draw(st.integers(0, 6)), prompt, draw(st.integers(1, 16)), draw(st.integers(0, 2))))
    return cfg, reqs


@settings(max_examples=120, deadline=None)
@given(workloads())
def test_random_workloads_finish_correctly_without_leaks(
    workload: tuple[dict[str, int], list[tuple[int, list[int], int, int]]],
) -> None:
    cfg, reqs = workload
    run_workload(cfg, reqs, FakeRunner(cfg["block_size"]))


def run_workload(cfg: dict[str, int], reqs: list[tuple[int, list[int], int, int]], runner: FakeRunner,
                 after_step: Callable[[Scheduler], None] | None = None) -> Scheduler:
    """Requests (arrival step, prompt, max_tokens, priority) through a scheduler built from cfg until all
    finish: each with the reference's tokens, by length, and every block free at the end."""
    sched = make_scheduler(**cfg)
    results: dict[str, Result] = {}
    pending = sorted(enumerate(reqs), key=lambda x: x[1][0])
    for t in range(5000):
        while pending and pending[0][1][0] <= t:  # requests arrive at different steps
            i, (_, prompt, max_tokens, priority) = pending.pop(0)
            sched.add_request(make_request(f"r{i}", prompt, float(i), priority, max_tokens=max_tokens))
        if not pending and not sched.has_unfinished_requests():
            break
        step(sched, runner, results)
        if after_step is not None:
            after_step(sched)
    assert not pending and not sched.has_unfinished_requests()
    event(f"preempted: {sched.num_preemptions > 0}")
    event(f"prefix hits: {sched.stats().prefix_cache_hits > 0}")
    for i, (_, prompt, max_tokens, _) in enumerate(reqs):
        assert results[f"r{i}"].token_ids == reference(prompt, max_tokens, cfg["max_model_len"])
        assert results[f"r{i}"].finish_reason == "length"
    assert_all_free(sched)
    return sched
