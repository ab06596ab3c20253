"""Priority classes in the scheduler: interactive requests before batch lines in the queue, a
waiting interactive request takes a batch line's seat and blocks, batch lines are preempted first
under KV pressure, batches take turns, and vLLM's `priority` orders requests inside a class."""

from __future__ import annotations

import pytest

from tokenmill.config import EngineArgs
from tokenmill.core.request import PriorityClass, Request, RequestStatus
from tokenmill.sampling_params import SamplingParams

from .test_scheduler import EOS, FakeRunner, Result, assert_all_free, drive, make_scheduler, reference, step

BATCH = PriorityClass.BATCH


def make(rid: str, prompt: list[int], arrival: float, priority: int = 0, cls: int = PriorityClass.INTERACTIVE,
         group: str = "", max_tokens: int = 8) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens), (EOS,), arrival, priority, cls, group)


def admitted_order(runner: FakeRunner) -> list[str]:
    return [new.req_id for so in runner.outputs for new in so.scheduled_new_reqs]


def test_interactive_is_admitted_before_earlier_batch_lines_whatever_their_priority() -> None:
    sched = make_scheduler(max_num_seqs=1)
    runner = FakeRunner(4)
    sched.add_request(make("b0", [5, 6], 0.0, priority=-10, cls=BATCH, group="A"))
    sched.add_request(make("b1", [5, 7], 1.0, priority=-10, cls=BATCH, group="A"))
    sched.add_request(make("i0", [5, 8], 2.0, priority=5))
    drive(sched, runner)
    assert admitted_order(runner) == ["i0", "b0", "b1"]
    assert_all_free(sched)


def test_waiting_interactive_takes_a_running_batch_lines_seat() -> None:
    sched = make_scheduler(max_num_seqs=2, max_model_len=64)
    runner = FakeRunner(4)
    prompts = {"b0": [3] * 6, "b1": [4] * 6, "i0": [5] * 6}
    sched.add_request(make("b0", prompts["b0"], 0.0, cls=BATCH, group="A", max_tokens=20))
    sched.add_request(make("b1", prompts["b1"], 1.0, cls=BATCH, group="A", max_tokens=20))
    results: dict[str, Result] = {}
    step(sched, runner, results)
    assert {r.request_id for r in sched.running} == {"b0", "b1"}
    sched.add_request(make("i0", prompts["i0"], 2.0, max_tokens=20))
    so = step(sched, runner, results)
    assert "i0" in so.num_scheduled_tokens  # admitted at once, not after a batch line finished
    assert sched.num_preemptions == 1
    victim = next(r for r in sched.waiting if r.status == RequestStatus.PREEMPTED)
    assert victim.request_id == "b1"  # the newest batch line
    drive(sched, runner, results)
    for rid, prompt in prompts.items():  # the preempted line resumes and its output joins up exactly
        assert results[rid].token_ids == reference(prompt, 20, 64), rid
    assert_all_free(sched)


def test_waiting_interactive_takes_batch_blocks_and_never_interactive_ones() -> None:
    # 6 blocks of 4: the interactive request and one batch line hold 2 blocks each, a second batch line too
    sched = make_scheduler(num_blocks=6, block_size=4, budget=64, max_num_seqs=8, max_model_len=24)
    runner = FakeRunner(4)
    sched.add_request(make("i0", [3] * 7, 0.0, max_tokens=12))
    sched.add_request(make("b0", [4] * 7, 1.0, cls=BATCH, group="A", max_tokens=12))
    sched.add_request(make("b1", [6] * 7, 1.5, cls=BATCH, group="A", max_tokens=12))
    results: dict[str, Result] = {}
    step(sched, runner, results)
    assert sched.kv.num_free_blocks == 0
    sched.add_request(make("i1", [5] * 7, 2.0, max_tokens=12))
    so = step(sched, runner, results)
    assert "i1" in so.num_scheduled_tokens and "i0" in so.num_scheduled_tokens
    preempted = {r.request_id for r in sched.waiting if r.status == RequestStatus.PREEMPTED}
    assert preempted and preempted <= {"b0", "b1"}
    drive(sched, runner, results)
    assert results["i1"].token_ids == reference([5] * 7, 12, 24)
    assert results["b0"].token_ids == reference([4] * 7, 12, 24)
    assert_all_free(sched)


def test_kv_pressure_preempts_batch_before_interactive_even_with_better_priority() -> None:
    sched = make_scheduler(num_blocks=8, block_size=4, budget=64, max_num_seqs=2, max_model_len=32)
    runner = FakeRunner(4)
    sched.add_request(make("batch", [3] * 8, 0.0, priority=-100, cls=BATCH, group="A", max_tokens=20))
    sched.add_request(make("online", [4] * 8, 1.0, priority=100, max_tokens=20))
    results: dict[str, Result] = {}
    victims = []
    while sched.has_unfinished_requests():
        step(sched, runner, results)
        victims += [r.request_id for r in sched.waiting if r.status == RequestStatus.PREEMPTED]
    assert victims and set(victims) == {"batch"}
    assert results["online"].token_ids == reference([4] * 8, 20, 32)
    assert results["batch"].token_ids == reference([3] * 8, 20, 32)
    assert_all_free(sched)


def test_batches_take_turns() -> None:
    sched = make_scheduler(max_num_seqs=1)
    runner = FakeRunner(4)
    for i in range(4):  # batch A submits all its lines first
        sched.add_request(make(f"A{i}", [5, i + 2], float(i), cls=BATCH, group="A", max_tokens=2))
    for i in range(4):
        sched.add_request(make(f"B{i}", [6, i + 2], 10.0 + i, cls=BATCH, group="B", max_tokens=2))
    drive(sched, runner)
    assert admitted_order(runner) == ["A0", "B0", "A1", "B1", "A2", "B2", "A3", "B3"]


def test_a_batch_that_starts_later_shares_from_then_on() -> None:
    sched = make_scheduler(max_num_seqs=1)
    runner = FakeRunner(4)
    for i in range(6):
        sched.add_request(make(f"A{i}", [5, i + 2], float(i), cls=BATCH, group="A", max_tokens=1))
    results: dict[str, Result] = {}
    while len(admitted_order(runner)) < 3:
        step(sched, runner, results)
    for i in range(3):
        sched.add_request(make(f"B{i}", [6, i + 2], 10.0 + i, cls=BATCH, group="B", max_tokens=1))
    drive(sched, runner, results)
    # B starts at the current turn: it neither jumps over all of A's remaining lines nor waits behind them
    assert admitted_order(runner) == ["A0", "A1", "A2", "B0", "A3", "B1", "A4", "B2", "A5"]


def test_priority_orders_within_the_batch_class() -> None:
    sched = make_scheduler(max_num_seqs=1)
    runner = FakeRunner(4)
    for rid, priority, arrival in (("p3", 3, 0.0), ("p1", 1, 1.0), ("p2", 2, 2.0)):
        sched.add_request(make(rid, [5, 6], arrival, priority=priority, cls=BATCH, group="A", max_tokens=2))
    drive(sched, runner)
    assert admitted_order(runner) == ["p1", "p2", "p3"]


def test_batch_lines_get_their_share_of_a_step_while_interactive_requests_run() -> None:
    # budget 64, lower classes' share 3: while i0 is in the engine the batch lines' prefill chunks take 3
    # tokens a step on average; while i0 only decodes, they wait (the step stays pure decode) until 8 steps'
    # share (24) is saved, then go in one step. Their decode rows are not charged to the share and go into
    # every step. Once i0 is done they get the whole budget.
    sched = make_scheduler(num_blocks=96, lower_share=3, max_model_len=256)
    runner = FakeRunner(4)
    prompts = {"b0": [3] * 6, "b1": [4] * 150, "i0": [5] * 6}
    max_tokens = {"b0": 40, "b1": 4, "i0": 40}
    sched.add_request(make("b0", prompts["b0"], 0.0, cls=BATCH, group="A", max_tokens=max_tokens["b0"]))
    sched.add_request(make("b1", prompts["b1"], 1.0, cls=BATCH, group="A", max_tokens=max_tokens["b1"]))
    sched.add_request(make("i0", prompts["i0"], 2.0, max_tokens=max_tokens["i0"]))
    results: dict[str, Result] = {}
    done = {"b0": 0, "b1": 0}  # each batch line's tokens scheduled so far
    prefill: list[int] = []  # the batch lines' prompt tokens in each step
    decoding = 0
    while "i0" in sched.requests:
        live = set(sched.requests)
        so = step(sched, runner, results)
        assert so.num_scheduled_tokens.get("i0") == (6 if not prefill else 1)  # never held back
        chunk = 0
        for rid in done:
            n = so.num_scheduled_tokens.get(rid, 0)
            if done[rid] >= len(prompts[rid]) and rid in live:  # a decode row, in every step till it ends
                assert n == 1, (rid, so.num_scheduled_tokens)
                decoding += 1
            else:
                chunk += n
            done[rid] += n
        prefill.append(chunk)
        if prefill[1:] and chunk:  # a step with a batch prefill chunk beside i0's decode row
            assert chunk <= 24 and not any(prefill[-8:-1]), prefill  # the burst: 8 steps saved up
    assert prefill[0] == 3  # i0's prefill step takes the share's prefill chunk too
    assert done["b1"] < len(prompts["b1"])  # (so the share always had prefill work to take)
    assert decoding >= 30, decoding
    # the share went to prefill chunks, all but what was saved up at the end: b0's decode rows took none of it
    assert 3 * len(prefill) - 24 <= sum(prefill) <= 3 * len(prefill), prefill
    assert sum(n == 0 for n in prefill) >= 20, prefill  # steps left pure decode
    so = step(sched, runner, results)
    assert so.num_scheduled_tokens.get("b0", 0) + so.num_scheduled_tokens.get("b1", 0) > 3
    drive(sched, runner, results)
    for rid, prompt in prompts.items():  # chunked as the share allows, the tokens are still exact
        assert results[rid].token_ids == reference(prompt, max_tokens[rid], 256), rid
    assert_all_free(sched)


def test_batch_step_tokens_flag() -> None:
    args = EngineArgs(model="unused", batch_step_tokens=0)
    with pytest.raises(ValueError, match="batch_step_tokens must be >= 1"):
        args._check_positive()
