"""Async scheduling: the engine core schedules and prepares step N+1 before step N has run, with
N's sampled tokens as placeholders (or, for pipeline parallelism, without the requests whose tokens
are in flight, so that the two steps in flight hold different requests). Driven through
EngineCore.step with the scheduler tests' fake runner (shadow KV memory, hash model), whose steps run
only when their output is waited for, so every step is prepared a step ahead, as on the real worker
thread.
"""

from __future__ import annotations

import zlib
from array import array
from collections import deque
from concurrent.futures import Future
from types import SimpleNamespace
from typing import cast

from hypothesis import event, given, settings
from hypothesis import strategies as st

from tokenmill.config import CacheConfig, EngineConfig, SchedulerConfig
from tokenmill.core.messages import EngineCoreOutput, EngineCoreRequest
from tokenmill.core.sched_output import ModelRunnerOutput, SchedulerOutput
from tokenmill.engine.core import EngineCore
from tokenmill.kv_cache_spec import KVCacheConfig
from tokenmill.sampling_params import SamplingParams
from tokenmill.structured_outputs_config import StructuredOutputsConfig

from .test_scheduler import EOS, VOCAB, FakeRunner, PreparedStep, Result, workloads


class RunWhenAwaited(Future[ModelRunnerOutput]):
    def __init__(self, executor: FakeExecutor) -> None:
        super().__init__()
        self.executor = executor

    def result(self, timeout: float | None = None) -> ModelRunnerOutput:
        self.executor.run_through(self)
        return super().result(timeout)


class FakeExecutor:
    def __init__(self, runner: FakeRunner, num_blocks: int, tokens_in_flight: bool = True) -> None:
        self.runner = runner
        self.num_blocks = num_blocks
        self.queue: deque[tuple[PreparedStep, RunWhenAwaited]] = deque()
        self.max_queued = 0
        self.tokens_in_flight = tokens_in_flight  # False: a step never needs a token a queued step samples

    def initialize_kv_cache(self) -> KVCacheConfig:
        return KVCacheConfig(self.num_blocks, self.runner.block_size, ())

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        assert not self.queue
        return self.runner.execute(so)

    def submit(self, so: SchedulerOutput) -> Future[ModelRunnerOutput]:
        future = RunWhenAwaited(self)
        if not self.tokens_in_flight:
            waiting = [rid for rid in so.num_scheduled_tokens
                       if rid in self.runner.states and self.runner.states[rid].samples_in_flight]
            assert not waiting, f"{waiting} scheduled while their tokens are in flight"
        self.queue.append((self.runner.prepare(so), future))
        self.max_queued = max(self.max_queued, len(self.queue))
        return future

    def run_through(self, future: RunWhenAwaited) -> None:
        while not future.done():
            step, f = self.queue.popleft()  # in the order submitted
            f.set_result(self.runner.run(step))

    def shutdown(self) -> None:
        assert not self.queue


def make_core(num_blocks: int, block_size: int, budget: int, max_num_seqs: int, max_model_len: int,
              async_scheduling: bool = True, pipeline: bool = False) -> tuple[EngineCore, FakeExecutor]:
    """`pipeline`: the scheduler config of pipeline parallelism (no placeholders)."""
    config = SimpleNamespace(
        scheduler=SchedulerConfig(max_num_seqs, budget, max_model_len, async_scheduling,
                                  schedule_tokens_in_flight=not pipeline),
        cache=CacheConfig(block_size, 0, num_blocks, True),
        model=SimpleNamespace(max_model_len=max_model_len, tokenizer="",
                              arch=SimpleNamespace(vocab_size=VOCAB, eos_token_ids=(EOS,))),
        speculative=None,
        kv_transfer=None,
        structured_outputs=StructuredOutputsConfig(),
        device=SimpleNamespace(device="cpu"),
        log_stats=False)  # no model shapes here for the step meter to count with
    executor = FakeExecutor(FakeRunner(block_size, lambda rid, tokens: eos_model(tokens)), num_blocks, not pipeline)
    return EngineCore(cast(EngineConfig, config), executor), executor


def eos_model(tokens: list[int]) -> int:
    """A hash of the whole sequence, EOS about one time in eight."""
    h = zlib.crc32(array("q", tokens).tobytes())
    return EOS if h % 8 == 0 else 2 + h % (VOCAB - 2)


def reference(prompt: list[int], max_tokens: int, max_model_len: int, ignore_eos: bool) -> tuple[list[int], str]:
    tokens, out = list(prompt), []
    while True:
        tok = eos_model(tokens)
        tokens.append(tok)
        out.append(tok)
        if tok == EOS and not ignore_eos:
            return out, "stop"
        if len(out) >= max_tokens or len(tokens) >= max_model_len:
            return out, "length"


def request(rid: str, prompt: list[int], arrival: float, max_tokens: int, ignore_eos: bool,
            priority: int = 0) -> EngineCoreRequest:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos)
    return EngineCoreRequest(rid, prompt, params, (EOS,), arrival, priority)


def collect(results: dict[str, Result], outputs: list[EngineCoreOutput]) -> None:
    for out in outputs:
        res = results.setdefault(out.request_id, Result())
        assert res.finish_reason is None, f"output for {out.request_id} after it finished"
        res.token_ids.extend(out.new_token_ids)
        res.finish_reason = out.finish_reason


def assert_all_free(core: EngineCore) -> None:
    sched = core.scheduler
    assert not core.has_unfinished_requests() and not sched.requests
    assert sched.kv.num_free_blocks == sched.kv.pool.num_blocks and not sched.kv.req_blocks


@settings(max_examples=150, deadline=None)
@given(workloads(), st.data())
def test_async_steps_give_the_synchronous_results_without_leaks(
    workload: tuple[dict[str, int], list[tuple[int, list[int], int, int]]], data: st.DataObject,
) -> None:
    cfg, base = workload
    # each request also: whether it ignores EOS, and whether it is aborted so many steps after it arrives
    reqs = [(*r, data.draw(st.booleans()), data.draw(st.none() | st.integers(1, 12))) for r in base]
    core, executor = make_core(cfg["num_blocks"], cfg["block_size"], cfg["budget"], cfg["max_num_seqs"],
                               cfg["max_model_len"])
    results: dict[str, Result] = {}
    aborted = drive_core(core, reqs, results)
    event(f"preempted: {core.scheduler.num_preemptions > 0}")
    event(f"two steps in flight: {executor.max_queued == 2}")
    for i, (_, prompt, max_tokens, _, ignore_eos, _) in enumerate(reqs):
        rid = f"r{i}"
        tokens, reason = reference(prompt, max_tokens, cfg["max_model_len"], ignore_eos)
        got = results[rid].token_ids
        if rid in aborted:  # what it got before the abort is a prefix of the full answer
            assert results[rid].finish_reason == "abort" and tokens[:len(got)] == got
        else:
            assert (got, results[rid].finish_reason) == (tokens, reason)
    assert_all_free(core)
    core.shutdown()


@settings(max_examples=100, deadline=None)
@given(workloads())
def test_pipeline_steps_hold_other_requests(
    workload: tuple[dict[str, int], list[tuple[int, list[int], int, int]]],
) -> None:
    """Under pipeline parallelism a request whose token is in flight waits for it (FakeExecutor checks
    every step), so the steps in flight run other requests; the results are the synchronous ones."""
    cfg, base = workload
    reqs = [(*r, True, None) for r in base]
    core, executor = make_core(cfg["num_blocks"], cfg["block_size"], cfg["budget"], cfg["max_num_seqs"],
                               cfg["max_model_len"], pipeline=True)
    results: dict[str, Result] = {}
    drive_core(core, reqs, results)
    event(f"two steps in flight: {executor.max_queued == 2}")
    for i, (_, prompt, max_tokens, _, ignore_eos, _) in enumerate(reqs):
        assert (results[f"r{i}"].token_ids, results[f"r{i}"].finish_reason) == reference(
            prompt, max_tokens, cfg["max_model_len"], ignore_eos)
    assert executor.max_queued <= 2
    assert_all_free(core)
    core.shutdown()


def test_two_stages_overlap_two_requests() -> None:
    """Two decoding requests in two steps in flight at once, each waiting only for its own token."""
    core, executor = make_core(32, 4, 3, 4, 64, pipeline=True)  # a budget of 3: one prompt per step
    core.add_request(request("a", [5, 6, 7], 0.0, max_tokens=6, ignore_eos=True))
    core.add_request(request("b", [8, 9, 10], 0.0, max_tokens=6, ignore_eos=True))
    results: dict[str, Result] = {}
    while core.has_unfinished_requests():
        collect(results, core.step().outputs)
    steps = [set(so.num_scheduled_tokens) for so in executor.runner.outputs if so.num_scheduled_tokens]
    assert steps[:4] == [{"a"}, {"b"}, {"a"}, {"b"}] and executor.max_queued == 2
    assert results["a"].token_ids == reference([5, 6, 7], 6, 64, True)[0]
    assert results["b"].token_ids == reference([8, 9, 10], 6, 64, True)[0]
    assert_all_free(core)


def drive_core(core: EngineCore, reqs: list[tuple[int, list[int], int, int, bool, int | None]],
               results: dict[str, Result]) -> set[str]:
    """Steps the core until every request is done: request i (arrival step, prompt, max_tokens, priority,
    ignore_eos, aborted so many steps after it arrives or None) is added as r{i} at its arrival step.
    Collects the outputs into `results`; returns the aborted requests' ids."""
    pending = sorted(enumerate(reqs), key=lambda x: x[1][0])
    aborts: dict[int, list[str]] = {}
    aborted: set[str] = set()
    for t in range(5000):
        while pending and pending[0][1][0] <= t:  # requests arrive at different steps
            i, (_, prompt, max_tokens, priority, ignore_eos, abort_at) = pending.pop(0)
            core.add_request(request(f"r{i}", prompt, float(i), max_tokens, ignore_eos, priority))
            if abort_at is not None:
                aborts.setdefault(t + abort_at, []).append(f"r{i}")
        for out in core.abort_requests(aborts.pop(t, [])).outputs:
            aborted.add(out.request_id)
            collect(results, [out])
        if not pending and not core.has_unfinished_requests():
            break
        collect(results, core.step().outputs)
    assert not pending and not core.has_unfinished_requests()
    return aborted


def test_no_step_is_scheduled_past_max_tokens() -> None:
    # with its last token in flight, a request is not scheduled again: no computed token is thrown away
    core, executor = make_core(32, 4, 64, 4, 64)
    core.add_request(request("a", [5, 6, 7], 0.0, max_tokens=5, ignore_eos=True))
    results: dict[str, Result] = {}
    while core.has_unfinished_requests():
        collect(results, core.step().outputs)
    scheduled = [so.num_scheduled_tokens.get("a", 0) for so in executor.runner.outputs]
    assert sum(scheduled) == 3 + 4  # the prompt, then one step per sampled token but the last
    assert executor.max_queued == 2
    assert results["a"].token_ids == reference([5, 6, 7], 5, 64, True)[0]
    assert_all_free(core)


def test_a_stop_wastes_at_most_the_step_in_flight() -> None:
    prompt = next(p for p in ([i, i + 1] for i in range(10, 500)) if reference(p, 30, 64, False)[1] == "stop"
                  and len(reference(p, 30, 64, False)[0]) > 2)
    tokens, _ = reference(prompt, 30, 64, False)
    core, executor = make_core(32, 4, 64, 4, 64)
    core.add_request(request("a", prompt, 0.0, max_tokens=30, ignore_eos=False))
    results: dict[str, Result] = {}
    while core.has_unfinished_requests():
        collect(results, core.step().outputs)
    assert results["a"].token_ids == tokens and results["a"].finish_reason == "stop"
    steps = [so for so in executor.runner.outputs if "a" in so.num_scheduled_tokens]
    assert len(steps) == len(tokens) + 1  # prefill, one step per token after the first, one thrown away
    assert_all_free(core)
