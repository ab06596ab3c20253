"""The Ray executor on a local cluster the test starts (`ray start --head` on 127.0.0.1, 4 CPUs): two ranks
as Ray actors, tensor-parallel or as two pipeline stages, generate what transformers does, greedy, in
a mixed batch with chunked prefill, preemption, prefix-cache hits and async scheduling; an actor killed
mid-generation, or while the engine is idle, ends the engine with an error that names it within
seconds; an address nothing answers at, and more ranks than the cluster's CPUs can place, are one clear
error at start; `tokenmill serve` over Ray actors answers as one rank does."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
import ray

from tests.entrypoints.server import RemoteServer, free_port
from tests.entrypoints.test_serve_cli import assert_one_line_error, serve
from tests.executor.ray_cluster import local_ray_cluster
from tests.executor.test_multiproc import DEADLINE_S, assert_peers_stopped_and_engine_closed, step_until_error
from tests.models.test_golden import MAX_TOKENS, PROMPTS, check_prefix_hits, expected, greedy, run
from tokenmill import LLM, SamplingParams
from tokenmill.executor.abstract import WorkerDied


@pytest.fixture(scope="module")
def ray_address() -> Iterator[str]:
    with local_ray_cluster() as address:
        before = os.environ.get("RAY_ADDRESS")
        os.environ["RAY_ADDRESS"] = address  # the engine (and a server it starts) connects here
        try:
            yield address
        finally:
            if before is None:
                os.environ.pop("RAY_ADDRESS", None)
            else:
                os.environ["RAY_ADDRESS"] = before


def ray_llm(model_dir: str, **kw: Any) -> LLM:
    return LLM(model_dir, dtype="float32", tensor_parallel_size=2, distributed_executor_backend="ray",
               **{"kv_cache_memory": "8MiB", **kw})


def test_golden_mixed_batch(ray_address: str, model_dirs: dict[str, str]) -> None:
    # one KV head replicated on both ranks; 12 blocks of 16 tokens: max_model_len 96 fits, the batch does
    # not (preemption); 16-token steps (chunked prefill); the next step scheduled while one runs
    model_dir = model_dirs["llama-gqa4-untied"]
    llm = ray_llm(model_dir, num_kv_blocks=12, block_size=16, max_model_len=96, kv_cache_memory=None,
                  max_num_batched_tokens=16, async_scheduling=True)
    try:
        assert len(set(llm.engine.core.executor.pids)) == 2  # type: ignore[attr-defined]
        assert os.getpid() not in llm.engine.core.executor.pids  # type: ignore[attr-defined]
        assert run(llm, PROMPTS, MAX_TOKENS) == expected(model_dir, PROMPTS, MAX_TOKENS)
        assert llm.engine.core.scheduler.num_preemptions > 0
        check_prefix_hits(llm, model_dir)
    finally:
        llm.shutdown()
    assert not ray.is_initialized()  # the engine's connection is closed with it


def test_golden_pipeline_through_ray(ray_address: str, model_dirs: dict[str, str]) -> None:
    # two stages as Ray actors: the last stage's rank answers each step, the first stage holds the
    # embedding; two steps in flight (async scheduling), preemption and prefix-cache hits
    model_dir = model_dirs["llama-gqa4-untied"]
    llm = LLM(model_dir, dtype="float32", pipeline_parallel_size=2, distributed_executor_backend="ray",
              num_kv_blocks=12, block_size=16, max_model_len=96, max_num_batched_tokens=16,
              async_scheduling=True)
    try:
        assert len(set(llm.engine.core.executor.pids)) == 2  # type: ignore[attr-defined]
        assert run(llm, PROMPTS, MAX_TOKENS) == expected(model_dir, PROMPTS, MAX_TOKENS)
        assert llm.engine.core.scheduler.num_preemptions > 0
        check_prefix_hits(llm, model_dir)
    finally:
        llm.shutdown()
    assert not ray.is_initialized()


@pytest.mark.parametrize("idle", [False, True])
def test_actor_killed(ray_address: str, llama_dir: str, idle: bool) -> None:
    llm = ray_llm(llama_dir)
    executor: Any = llm.engine.core.executor
    rank = 0 if idle else 1
    pid = executor.pids[rank]
    try:
        if not idle:
            llm.engine.add_request("long", PROMPTS[0], greedy(400))
            for _ in range(3):
                llm.engine.step()
            assert llm.engine.has_unfinished_requests()
        started = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        if idle:
            while True:
                try:
                    llm.engine.core.check_health()
                except WorkerDied as e:
                    error: BaseException | None = e
                    break
                assert time.monotonic() - started < DEADLINE_S, "the dead actor was not noticed"
                time.sleep(0.05)
        else:
            error = step_until_error(llm)
        assert isinstance(error, WorkerDied), error
        assert f"worker rank {rank} (Ray actor, pid {pid} on " in str(error) and ") died: ActorDiedError" in str(error)
        assert time.monotonic() - started < 10
        assert_peers_stopped_and_engine_closed(llm, executor.pids)
    finally:
        llm.shutdown()


def test_unreachable_address(llama_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    monkeypatch.setenv("RAY_ADDRESS", address)
    started = time.monotonic()
    with pytest.raises(ValueError, match=f"the Ray cluster at {address} \\(RAY_ADDRESS\\) is not reachable"):
        ray_llm(llama_dir)
    assert time.monotonic() - started < 15
    result = serve(llama_dir, "--port", str(free_port()), "--tensor-parallel-size", "2",
                   "--distributed-executor-backend", "ray")  # (the server's child inherits RAY_ADDRESS)
    assert_one_line_error(result, f"the Ray cluster at {address} (RAY_ADDRESS) is not reachable")


def test_more_ranks_than_the_cluster_places(ray_address: str, llama_dir: str,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # 2 ranks of 3 CPUs each: the cluster has 4 in all
    with pytest.raises(ValueError, match="2 ranks of 3 CPU each need 6 CPU; the Ray cluster has 4"):
        ray_llm(llama_dir, num_threads=6)
    assert not ray.is_initialized()
    # 2 ranks of 1 CPU, while 3 of the 4 are held by another placement group
    import tokenmill.executor.ray as ray_executor

    monkeypatch.setattr(ray_executor, "PLACEMENT_TIMEOUT_S", 2.0)
    ray.init(address=ray_address, logging_level="WARNING")
    try:
        held = ray.util.placement_group([{"CPU": 3}])
        ray.get(held.ready(), timeout=30)
        with pytest.raises(ValueError, match="the Ray cluster did not place 2 ranks .* within 2 s"):
            ray_llm(llama_dir, num_threads=2)
        ray.util.remove_placement_group(held)
        assert ray.is_initialized()  # the caller's own connection is left open
    finally:
        ray.shutdown()


def test_serve_through_ray(ray_address: str, llama_dir: str) -> None:
    prompts = ["def main():", "import os\nimport sys"]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    one_rank = LLM(llama_dir, kv_cache_memory="8MiB")
    want = [o.outputs[0].text for o in one_rank.generate(prompts, params, use_tqdm=False)]
    srv = RemoteServer(llama_dir, "--tensor-parallel-size", "2", "--distributed-executor-backend", "ray")
    try:
        with srv.client() as http:
            r = http.post("/v1/completions", json={"prompt": prompts, "max_tokens": 12, "temperature": 0.0,
                                                   "ignore_eos": True})
            assert r.status_code == 200, r.text
            assert [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])] == want
            assert http.get("/health").status_code == 200
    finally:
        assert srv.stop() == 0
