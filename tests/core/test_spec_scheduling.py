"""Speculative decoding in the scheduler, with the scheduler tests' fake runner: its shadow KV memory
holds each draft's (position, token) where the step wrote it, so a rejected draft whose KV the
scheduler does not roll back, or a block holding one that it caches, fails the step that reads it.
The fake runner verifies drafts greedily against the hash model; the proposers here range from
right (the model's own continuation) to always wrong."""

from __future__ import annotations

import zlib
from array import array
from collections.abc import Sequence

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from tokenmill.config import CacheConfig, SchedulerConfig
from tokenmill.core.scheduler import Scheduler

from .test_scheduler import (
    EOS,
    FakeRunner,
    Proposer,
    Result,
    assert_all_free,
    check_step,
    drive,
    hash_model,
    make_request,
    make_scheduler,
    reference,
    run_workload,
    scripted,
    step,
    workloads,
)


def oracle(k: int) -> Proposer:
    """The hash model's next k tokens: every draft is accepted."""
    def propose(rid: str, tokens: list[int]) -> list[int]:
        out: list[int] = []
        for _ in range(k):
            out.append(hash_model(tokens + out))
        return out

    return propose


def garbage(k: int) -> Proposer:
    """Drafts the hash model never gives (it never says 1): every one is rejected."""
    return lambda rid, tokens: [1] * k


def partly_right(k: int) -> Proposer:
    """The model's next m tokens then wrong ones, m in [0, k] a hash of the sequence."""
    def propose(rid: str, tokens: list[int]) -> list[int]:
        m = zlib.crc32(array("q", tokens).tobytes()) % (k + 1)
        return (oracle(m)(rid, tokens) + [1] * k)[:k]

    return propose


PROPOSERS = {"oracle": oracle, "garbage": garbage, "partly_right": partly_right}


def assert_cache_holds_its_tokens(sched: Scheduler, runner: FakeRunner) -> None:
    """Every block in the prefix cache holds the KV of the tokens it is indexed by."""
    for block in sched.kv.pool.blocks:
        if block.token_ids is not None:
            written = [runner.memory[(block.block_id, off)][1] for off in range(len(block.token_ids))]
            assert written == list(block.token_ids), block


def run_all(sched: Scheduler, runner: FakeRunner, prompts: Sequence[list[int]], max_tokens: int
            ) -> tuple[dict[str, Result], int]:
    for i, prompt in enumerate(prompts):
        sched.add_request(make_request(f"r{i}", prompt, float(i), max_tokens=max_tokens))
    steps = 0
    results: dict[str, Result] = {}
    while sched.has_unfinished_requests():
        step(sched, runner, results)
        assert_cache_holds_its_tokens(sched, runner)
        steps += 1
    return results, steps


PROMPTS = [[10 + i] * (3 + 5 * i) for i in range(5)]


@pytest.mark.parametrize("name", list(PROPOSERS))
def test_drafts_give_the_same_tokens_and_right_ones_fewer_steps(name: str) -> None:
    plain, plain_steps = run_all(make_scheduler(budget=128), FakeRunner(4), PROMPTS, 20)
    runner = FakeRunner(4, propose=PROPOSERS[name](3))
    sched = make_scheduler(budget=128)
    results, steps = run_all(sched, runner, PROMPTS, 20)
    for i, prompt in enumerate(PROMPTS):
        assert results[f"r{i}"].token_ids == plain[f"r{i}"].token_ids == reference(prompt, 20, 64)
    scheduled = [so.scheduled_spec_decode_tokens for so in runner.outputs]
    assert any(scheduled) and all(len(d) <= 3 for spec in scheduled for d in spec.values())
    if name == "oracle":  # a prefill step, then 4 tokens a step (3 drafts and one more): 1 + ceil(19 / 4)
        assert steps == 1 + 5 < plain_steps == 20
    elif name == "garbage":
        assert steps == plain_steps
    assert_all_free(sched)


def test_drafts_are_bounded_by_max_tokens_max_model_len_and_the_budget() -> None:
    sched = make_scheduler(budget=9, max_model_len=30)
    runner = FakeRunner(4, propose=oracle(10))
    sched.add_request(make_request("a", [5] * 4, 0.0, max_tokens=8))  # max_tokens bounds its drafts
    sched.add_request(make_request("b", [6] * 10, 1.0, max_tokens=100))  # max_model_len bounds its drafts
    results: dict[str, Result] = {}
    budget_cut = False
    while sched.has_unfinished_requests():
        so = sched.schedule()
        check_step(sched, so)
        for rid, drafts in so.scheduled_spec_decode_tokens.items():
            req = sched.requests[rid]
            room = min(req.sampling_params.max_tokens - req.num_output_tokens, 30 - req.num_tokens) - 1  # type: ignore[operator]
            assert len(drafts) <= room
            budget_cut |= len(drafts) < min(room, 10)
        for out in sched.update_from_output(so, runner.execute(so)):
            results.setdefault(out.request_id, Result()).token_ids.extend(out.new_token_ids)
    assert budget_cut  # the budget of 9 cut some step's drafts short
    assert results["a"].token_ids == reference([5] * 4, 8, 30)
    assert results["b"].token_ids == reference([6] * 10, 100, 30) and len(results["b"].token_ids) == 20
    assert_all_free(sched)


@pytest.mark.parametrize(
    ("params", "script", "tokens", "reason", "stop_reason"),
    [
        ({}, [5, 6, EOS, 7, 8, 9], [5, 6, EOS], "stop", None),
        ({"stop_token_ids": [6]}, [5, 6, 7, 8, 9], [5, 6], "stop", 6),
        ({"max_tokens": 3}, [5, 6, 7, 8, 9], [5, 6, 7], "length", None),
        ({"min_tokens": 4}, [EOS, 6, EOS, 5, EOS, 9], [EOS, 6, EOS, 5, EOS], "stop", None),
    ],
    ids=["eos", "stop_token_ids", "max_tokens", "min_tokens_eos"],
)
def test_a_stop_inside_an_accepted_run_cuts_it_there(params: dict[str, object], script: list[int],
                                                     tokens: list[int], reason: str, stop_reason: int | None) -> None:
    prompt = [9, 9, 9]

    def propose(rid: str, seq: list[int]) -> list[int]:  # the script's next 5: all accepted
        done = len(seq) - len(prompt)
        return (script[done:] + [1] * 5)[:5]

    sched = make_scheduler()
    runner = FakeRunner(4, scripted({"a": script + [11] * 10}), propose)
    sched.add_request(make_request("a", prompt, 0.0, **{"max_tokens": 10, **params}))
    results = drive(sched, runner)
    assert results["a"].token_ids == tokens
    assert (results["a"].finish_reason, results["a"].stop_reason) == (reason, stop_reason)
    assert len(runner.outputs) == 2  # the prefill, then one step that took the whole run
    assert_all_free(sched)


def test_abort_mid_speculation_frees_every_block() -> None:
    sched = make_scheduler(num_blocks=32)
    runner = FakeRunner(4, propose=partly_right(4))
    for i in range(3):
        sched.add_request(make_request(f"r{i}", [7 + i] * (5 + i), float(i), max_tokens=40))
    results: dict[str, Result] = {}
    for _ in range(3):
        step(sched, runner, results)
    assert all(r.spec_token_ids for r in sched.running)  # drafts waiting for the next step
    sched.abort_requests(["r0"])
    so = step(sched, runner, results)
    assert so.scheduled_spec_decode_tokens  # the others are mid-speculation
    sched.abort_requests(["r1", "r2"])
    assert_all_free(sched)
    assert sched.schedule().finished_req_ids == {"r1", "r2"}


def test_preempted_requests_drop_their_drafts_and_resume_correctly() -> None:
    sched = make_scheduler(num_blocks=8, block_size=4, budget=64, max_num_seqs=3, max_model_len=32)
    runner = FakeRunner(4, propose=partly_right(3))
    prompts = {"old": [3] * 8, "new": [4] * 8, "newer": [5] * 6}
    for i, (rid, prompt) in enumerate(prompts.items()):
        sched.add_request(make_request(rid, prompt, float(i), max_tokens=20))
    results = drive(sched, runner)
    assert sched.num_preemptions > 0
    for rid, prompt in prompts.items():
        assert results[rid].token_ids == reference(prompt, 20, 32), rid
    assert_all_free(sched)


@settings(max_examples=120, deadline=None)
@given(workloads(), st.sampled_from(list(PROPOSERS)), st.integers(1, 5))
def test_random_workloads_with_drafts_finish_correctly_without_leaks(
    workload: tuple[dict[str, int], list[tuple[int, list[int], int, int]]], proposer: str, k: int,
) -> None:
    cfg, reqs = workload
    runner = FakeRunner(cfg["block_size"], propose=PROPOSERS[proposer](k))
    run_workload(cfg, reqs, runner, after_step=lambda sched: assert_cache_holds_its_tokens(sched, runner))
    event(f"drafts: {any(so.scheduled_spec_decode_tokens for so in runner.outputs)}")


def test_drafts_need_sync_scheduling_in_the_scheduler() -> None:
    # with a step in flight a request's drafts would not follow its last token: they are not scheduled
    sched = Scheduler(SchedulerConfig(4, 64, 64, True), CacheConfig(4, 0, 32, True), 32)
    sched.add_request(make_request("a", [5, 6, 7], 0.0))
    sched.schedule()
    req = sched.requests["a"]
    req.spec_token_ids = [8, 9]
    assert req.num_output_placeholders == 1
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 1} and not so.scheduled_spec_decode_tokens
