"""Beam search's KV sharing in the scheduler, pure Python: requests that keep their blocks once
finished (hold_kv), children that start from a kept parent's blocks (kv_parent, a partial last block
shared too), copy-on-write before a shared block is written, and every block back in the pool
after a search, also one aborted mid-way or whose step failed.

The fake runner (tests/core/test_scheduler.py) reads every earlier position back through the block
table before a step and writes each computed one, and here also checks that no step writes into a
block another table holds; its "model" is a hash of the whole sequence, so a child whose shared or
copied KV were wrong would fail its read-back.
"""

from __future__ import annotations

import random

import pytest

from tests.core.test_scheduler import EOS, FakeRunner, Result, assert_all_free, drive, hash_model, make_scheduler, step
from tokenmill.core.request import Request
from tokenmill.core.scheduler import Scheduler
from tokenmill.sampling_params import SamplingParams

BLOCK = 4


def step_request(rid: str, tokens: list[int], share: bool, parent: str | None) -> Request:
    """One beam's request for one step, as engine/beam_search.py sends it."""
    return Request(rid, tokens, SamplingParams(max_tokens=1, ignore_eos=True), (EOS,),
                   hold_kv=share, kv_parent=parent if share else None)


def scheduled_tokens(runner: FakeRunner, rid: str) -> int:
    return sum(so.num_scheduled_tokens.get(rid, 0) for so in runner.outputs)


class Search:
    """A beam search's pattern of requests: each step one request per beam, the beam's tokens so far
    plus one; the beam it extends (its parent) is drawn at random from the step before's."""

    def __init__(self, sched: Scheduler, runner: FakeRunner, prompt: list[int], width: int,
                 share: bool = True, seed: int = 0) -> None:
        self.sched, self.runner, self.width, self.share = sched, runner, width, share
        self.rng = random.Random(seed)
        self.kept: list[tuple[str, list[int]]] = []  # the step before's requests: (id, tokens)
        self.prompt = prompt
        self.count = 0
        self.results: dict[str, Result] = {}

    def add_step(self) -> list[tuple[str, list[int]]]:
        """Add the next step's requests, then release the step before's kept blocks."""
        if not self.kept:
            beams = [(None, list(self.prompt))]
        else:
            beams = []
            for _ in range(self.width):
                parent, tokens = self.kept[self.rng.randrange(len(self.kept))]
                beams.append((parent, tokens + [self.rng.randrange(2, 50)]))
        added = []
        for parent, tokens in beams:
            self.count += 1
            rid = f"s{self.count}"
            self.sched.add_request(step_request(rid, tokens, self.share, parent))
            added.append((rid, tokens))
        self.release()
        self.kept = added
        return added

    def release(self) -> None:
        assert self.sched.abort_requests([rid for rid, _ in self.kept]) == []  # finished: no output

    def run(self, steps: int) -> None:
        for _ in range(steps):
            added = self.add_step()
            drive(self.sched, self.runner, self.results)
            for rid, tokens in added:  # each one read its whole context back and took the model's token
                assert self.results[rid].token_ids == [hash_model(tokens)], rid
                assert self.results[rid].finish_reason == "length"


def make(num_blocks: int = 64, prefix_caching: bool = True) -> tuple[Scheduler, FakeRunner]:
    sched = make_scheduler(num_blocks=num_blocks, block_size=BLOCK, budget=256, max_num_seqs=8,
                           prefix_caching=prefix_caching)
    runner = FakeRunner(BLOCK)
    runner.pool = sched.kv.pool
    return sched, runner


def test_children_share_every_block_and_copy_the_partial_one_before_writing() -> None:
    sched, runner = make()
    search = Search(sched, runner, list(range(10, 16)), width=3)  # 6 tokens: one full block, one partial
    search.run(1)
    (parent, prompt), = search.kept
    parent_blocks = sched.kv.block_ids(parent)
    assert sched.held == {parent: prompt} and len(parent_blocks) == 2  # kept after it finished
    children = []
    for i in range(3):
        rid = f"c{i}"
        sched.add_request(step_request(rid, prompt + [40 + i], True, parent))
        assert sched.kv.block_ids(rid) == parent_blocks  # both blocks, by reference
        assert sched.requests[rid].num_computed_tokens == len(prompt)
        children.append(rid)
    assert [sched.kv.pool.blocks[b].ref_cnt for b in parent_blocks] == [4, 4]
    search.release()
    assert not sched.held
    so = step(sched, runner, search.results)
    assert so.num_scheduled_tokens == dict.fromkeys(children, 1)  # nothing of the prefix is recomputed
    # the first two writers copy the shared partial block; the last one then holds it alone and writes in place
    assert [src for src, _ in so.blocks_to_copy] == [parent_blocks[1]] * 2
    tables = [sched.kv.block_ids(c) for c in children]
    assert all(t[0] == parent_blocks[0] for t in tables)
    assert tables[2][1] == parent_blocks[1] and len({t[1] for t in tables}) == 3
    assert [search.results[c].token_ids for c in children] == [[hash_model(prompt + [40 + i])] for i in range(3)]
    assert sched.stats().num_blocks_copied == 2
    sched.abort_requests(children)
    assert_all_free(sched)
    assert not sched.held


@pytest.mark.parametrize("prompt_len", [5, 8, 11])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_a_search_computes_each_token_once_and_leaves_every_block_free(prompt_len: int, prefix_caching: bool) -> None:
    width, steps = 4, 9
    sched, runner = make(prefix_caching=prefix_caching)
    search = Search(sched, runner, list(range(100, 100 + prompt_len)), width, seed=prompt_len)
    search.run(steps)
    # the prompt once, then one token per beam and step
    assert sched.num_scheduled_tokens == prompt_len + (steps - 1) * width
    assert all(scheduled_tokens(runner, rid) == 1 for rid in search.results if rid != "s1")
    search.release()
    assert_all_free(sched)
    assert not sched.held and not sched.kv.req_blocks


def test_sharing_against_recomputing_through_the_prefix_cache() -> None:
    """The same search (same parents, same tokens) with shared blocks and without: far fewer tokens
    computed; at the peak no more blocks than the prefix cache's sharing of full blocks (each beam
    needs its own partial block either way), and half or fewer with prefix caching off."""
    width, steps, prompt = 4, 10, list(range(200, 213))  # 13 tokens: not a multiple of the block size
    figures = {}
    for share in (True, False):
        for prefix_caching in (True, False):
            sched, runner = make(prefix_caching=prefix_caching)
            search = Search(sched, runner, prompt, width, share=share, seed=1)
            search.run(steps)
            search.release()
            assert_all_free(sched)
            figures[share, prefix_caching] = (sched.num_scheduled_tokens, sched.kv.pool.peak_used_blocks)
    assert figures[True, True][0] == figures[True, False][0] == len(prompt) + (steps - 1) * width
    assert figures[False, True][0] > 2 * figures[True, True][0]
    assert figures[True, True][1] <= figures[False, True][1]
    assert 2 * figures[True, False][1] <= figures[False, False][1]


def test_an_aborted_search_leaves_every_block_free() -> None:
    sched, runner = make()
    search = Search(sched, runner, list(range(30, 37)), width=4, seed=3)
    search.run(3)
    added = search.add_step()  # forked, parents released, not scheduled yet
    sched.abort_requests([rid for rid, _ in added])
    assert_all_free(sched)
    search.kept = []
    search.run(2)
    added = search.add_step()
    step(sched, runner, search.results)  # scheduled (copies made), then aborted with outputs unread
    outputs = sched.abort_requests([rid for rid, _ in added])
    assert_all_free(sched)
    assert not outputs or all(o.finish_reason in ("abort", None) for o in outputs)


def test_a_failed_step_leaves_every_block_free() -> None:
    sched, runner = make()
    search = Search(sched, runner, list(range(60, 66)), width=4, seed=4)
    search.run(1)
    added = search.add_step()  # four children of one parent, whose partial block they share
    so = sched.schedule()  # the step raises in the workers: the engine core fails its requests
    assert so.blocks_to_copy
    ended = sched.fail_requests({rid: "boom" for rid in so.num_scheduled_tokens})
    assert {o.request_id for o in ended} == {rid for rid, _ in added}
    assert not sched.held  # failed requests keep nothing
    assert_all_free(sched)


def test_kept_blocks_give_way_when_nothing_else_can_run() -> None:
    """A pool too small for a new request while kept and forked blocks take it: they are dropped (the
    forked requests compute from the start) rather than wait for ever."""
    sched, runner = make(num_blocks=6)
    search = Search(sched, runner, list(range(70, 79)), width=2, seed=5)  # 9 tokens: 3 blocks
    search.run(1)
    (parent, prompt), = search.kept
    sched.add_request(step_request("child", prompt + [5], True, parent))  # forked: 3 blocks, shared
    sched.add_request(Request("big", list(range(300, 318)), SamplingParams(max_tokens=2), (EOS,), priority=-1))
    results = drive(sched, runner, search.results)
    assert results["big"].finish_reason == "length"
    assert results["child"].token_ids == [hash_model(prompt + [5])]
    sched.abort_requests(["child", parent])
    assert_all_free(sched)


def test_a_child_whose_parent_is_not_kept_computes_everything() -> None:
    sched, runner = make()
    sched.add_request(step_request("orphan", [1, 2, 3, 4, 5], True, "nobody"))
    results = drive(sched, runner)
    assert results["orphan"].token_ids == [hash_model([1, 2, 3, 4, 5])]
    assert scheduled_tokens(runner, "orphan") == 5
    with pytest.raises(ValueError, match="in use"):
        sched.add_request(step_request("orphan", [1, 2], True, None))
    sched.abort_requests(["orphan"])
    assert_all_free(sched)
