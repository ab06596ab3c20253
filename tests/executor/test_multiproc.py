"""The multiprocess executor: a worker killed mid-generation (or while the engine is idle) ends the
engine with an error that names it, within seconds, the other workers stopped (a tensor-parallel rank,
or a pipeline stage: the first, whose peer waits for its hidden states, or the last, which answers); a failed call is an
error and the executor goes on; shutdown leaves no process behind; one rank in its own process
generates what the in-process executor does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest

from tests.models.test_golden import PROMPTS, expected, greedy, run
from tokenmill import LLM, SamplingParams
from tokenmill.executor.abstract import WorkerDied
from tokenmill.executor.multiproc import MultiprocExecutor

DEADLINE_S = 30.0  # far more than the seconds it takes; a hang fails the test instead of blocking it


def step_until_error(llm: LLM) -> BaseException | None:
    """Step the engine on a thread until it raises; the error, or None if it did not within DEADLINE_S."""
    box: list[BaseException] = []

    def loop() -> None:
        try:
            while llm.engine.has_unfinished_requests():
                llm.engine.step()
        except BaseException as e:
            box.append(e)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    thread.join(DEADLINE_S)
    return box[0] if box else None


def executor_of(llm: LLM) -> MultiprocExecutor:
    executor = llm.engine.core.executor
    assert isinstance(executor, MultiprocExecutor)
    return executor


def assert_peers_stopped_and_engine_closed(llm: LLM, pids: Sequence[int | None]) -> None:
    """After a rank's death: every other rank is stopped within seconds, and the engine takes nothing more."""
    deadline = time.monotonic() + 10
    while not all(gone(pid) for pid in pids):
        assert time.monotonic() < deadline, "a rank outlived its dead peer"
        time.sleep(0.05)
    with pytest.raises(WorkerDied):
        llm.engine.add_request("next", PROMPTS[1], greedy(4))
        llm.engine.step()


def gone(pid: int | None) -> bool:
    assert pid is not None
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.parametrize(("tp", "pp", "rank"), [(2, 1, 1), (2, 1, 0), (1, 2, 0), (1, 2, 1)])
def test_worker_killed_mid_generation(llama_dir: str, tp: int, pp: int, rank: int) -> None:
    # (stages: with two steps in flight, one on each)
    llm = LLM(llama_dir, dtype="float32", kv_cache_memory="8MiB", tensor_parallel_size=tp,
              pipeline_parallel_size=pp, async_scheduling=pp > 1)
    executor = executor_of(llm)
    try:
        llm.engine.add_request("long", PROMPTS[0], greedy(400))
        for _ in range(3):
            llm.engine.step()
        assert llm.engine.has_unfinished_requests()
        started = time.monotonic()
        os.kill(executor.pids[rank], signal.SIGKILL)  # type: ignore[arg-type]
        error = step_until_error(llm)
        assert isinstance(error, WorkerDied), error
        assert f"worker rank {rank} (pid {executor.pids[rank]}) died (killed by SIGKILL)" in str(error)
        assert time.monotonic() - started < DEADLINE_S
        assert_peers_stopped_and_engine_closed(llm, executor.pids)
    finally:
        llm.shutdown()


def test_worker_killed_while_idle_is_seen(llama_dir: str) -> None:
    llm = LLM(llama_dir, dtype="float32", kv_cache_memory="8MiB", tensor_parallel_size=2)
    try:
        executor = executor_of(llm)
        os.kill(executor.pids[1], signal.SIGKILL)  # type: ignore[arg-type]
        deadline = time.monotonic() + 10
        while True:
            try:
                llm.engine.core.check_health()
            except WorkerDied as e:
                assert "worker rank 1" in str(e)
                break
            assert time.monotonic() < deadline, "the dead worker was not noticed"
            time.sleep(0.05)
    finally:
        llm.shutdown()


def test_failed_call_then_shutdown(llama_dir: str) -> None:
    llm = LLM(llama_dir, dtype="float32", kv_cache_memory="8MiB", tensor_parallel_size=2)
    executor = executor_of(llm)
    pids: list[Any] = executor.collective_rpc("pid")
    assert pids == executor.pids and os.getpid() not in pids
    with pytest.raises(RuntimeError, match="worker rank 0: AttributeError: .*no_such_method"):
        executor.collective_rpc("no_such_method")
    assert executor.collective_rpc("pid") == pids  # a failed call is the caller's error, not the workers' end
    llm.shutdown()
    assert all(gone(pid) for pid in pids)
    with pytest.raises(WorkerDied, match="shut down"):
        executor.collective_rpc("pid")


def test_one_rank_in_its_own_process(llama_dir: str) -> None:
    llm = LLM(llama_dir, dtype="float32", kv_cache_memory="8MiB", distributed_executor_backend="mp")
    try:
        assert executor_of(llm).pids[0] != os.getpid()
        assert run(llm, PROMPTS[:4], [9, 3, 12, 5]) == expected(llama_dir, PROMPTS[:4], [9, 3, 12, 5])
    finally:
        llm.shutdown()


def test_engine_never_shut_down_exits_cleanly(llama_dir: str) -> None:
    """An engine left running at interpreter exit stops its workers itself (none reads as dead)."""
    code = (f"from tokenmill import LLM, SamplingParams\n"
            f"llm = LLM({llama_dir!r}, kv_cache_memory='8MiB', tensor_parallel_size=2)\n"
            f"print(len(llm.generate('x', SamplingParams(max_tokens=3), use_tqdm=False)[0].outputs[0].token_ids))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "3", result.stderr
    assert "died" not in result.stderr, result.stderr


@pytest.mark.parametrize(("async_scheduling", "tp", "pp"), [(False, 2, 1), (True, 2, 1), (True, 1, 2)])
def test_structured_output_reaches_the_ranks(llama_dir: str, async_scheduling: bool, tp: int, pp: int) -> None:
    """The step's token bitmasks (a Future the xgrammar thread fills) go to the ranks filled in: JSON
    outputs are valid, greedy and seeded, beside free requests that keep one rank's tokens (under
    pipeline parallelism the last stage applies them)."""
    from tests.structured.test_engine_structured import PROMPTS as JSON_PROMPTS
    from tests.structured.test_engine_structured import check_valid, constrained

    free = SamplingParams(temperature=0.0, max_tokens=8)
    params = [constrained(), constrained(seed=3), free, free]
    one = LLM(llama_dir, dtype="float32", num_kv_blocks=64, block_size=8, max_model_len=128, async_scheduling=False)
    expected_free = [o.outputs[0].token_ids for o in one.generate(JSON_PROMPTS[2:], free, use_tqdm=False)]
    llm = LLM(llama_dir, dtype="float32", num_kv_blocks=64, block_size=8, max_model_len=128,
              async_scheduling=async_scheduling, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    try:
        outs = llm.generate(JSON_PROMPTS, params, use_tqdm=False)
        check_valid(outs[:2])
        assert [o.outputs[0].token_ids for o in outs[2:]] == expected_free
    finally:
        llm.shutdown()
