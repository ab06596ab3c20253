"""`tokenmill serve --data-parallel-size 2`: two engine-core replicas behind one server generate what
one engine does (greedy), requests spread over both (the per-replica counter in /metrics), requests
sharing a prompt prefix go to the replica that holds it (and hit its prefix cache); a replica killed
under load ends its own requests with an error naming it, /health reports it, and the other replica
serves on. The stats of the replicas sum as one engine's."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.conftest import random_prompts
from tests.entrypoints.server import RemoteServer, free_port
from tests.entrypoints.test_serve_cli import assert_one_line_error, serve
from tests.entrypoints.test_serve_lifecycle import LONG, assert_stream_error, stream_lines
from tokenmill import LLM, SamplingParams
from tokenmill.core.messages import SchedulerStats, StepStats
from tokenmill.entrypoints.router.data_parallel import merge_stats

MAX_TOKENS = 8
DROPPED = 4  # long streams the client drops


def routed(http: httpx.Client) -> dict[str, float]:
    """Requests routed to each replica so far, from /metrics."""
    text = http.get("/metrics").text
    return {m.group(1): float(m.group(2))
            for m in re.finditer(r'^tokenmill:data_parallel_requests_total\{replica="(\d+)"\} (\S+)$', text, re.M)}


def prefix_hits(http: httpx.Client) -> float:
    m = re.search(r"^tokenmill:prefix_cache_hits_total\{[^}]*\} (\S+)$", http.get("/metrics").text, re.M)
    assert m is not None
    return float(m.group(1))


def complete(http: httpx.Client, prompt: list[int]) -> str:
    r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                                           "ignore_eos": True})
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


def replica_pids(srv: RemoteServer) -> list[int]:
    m = re.search(r"2 data-parallel replicas, engine core pids (\d+), (\d+)\)", srv.output())
    assert m is not None, srv.output()
    return [int(m.group(1)), int(m.group(2))]


def test_two_replicas(llama_dir: str) -> None:
    distinct = random_prompts(6, 5, 40, seed=11)
    shared = random_prompts(1, 96, 96, seed=12)[0]  # six 16-token chunks, three 32-token KV blocks
    same_prefix = [shared + tail for tail in random_prompts(4, 2, 6, seed=13)]
    # without the C++ kernels, here and in the server: the fused decode step runs this tiny model's 500 tokens
    # in less time than an abort takes to reach its replica, and the dropped streams below must be stopped
    one = LLM(llama_dir, kv_cache_memory="32MiB", max_model_len=512, cpu_kernels=False)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    want = {tuple(p): o.outputs[0].text
            for p, o in zip(distinct + same_prefix, one.generate(distinct + same_prefix, params, use_tqdm=False))}
    one.shutdown()
    srv = RemoteServer(llama_dir, "--data-parallel-size", "2", "--no-cpu-kernels")
    try:
        assert len(set(replica_pids(srv))) == 2
        with srv.client() as http, ThreadPoolExecutor(len(distinct)) as pool:
            got = list(pool.map(lambda p: complete(http, p), distinct))  # at once: spread by load
            assert got == [want[tuple(p)] for p in distinct]
            spread = routed(http)
            assert spread["0"] >= 2 and spread["1"] >= 2 and spread["0"] + spread["1"] == len(distinct), spread
            hits = prefix_hits(http)
            for prompt in same_prefix:  # one after another: each to the replica holding the prefix
                assert complete(http, prompt) == want[tuple(prompt)]
            after = routed(http)
            moved = sorted(after[k] - spread[k] for k in after)
            assert moved == [0, len(same_prefix)], (spread, after)
            # its three blocks, every time after the first
            assert prefix_hits(http) - hits >= (len(same_prefix) - 1) * 96
            assert http.get("/health").status_code == 200
            decoded = decode_tokens(http)
            for _ in range(DROPPED):  # streams dropped after their first token: aborted in their replica
                with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
                    next(r.iter_lines())
            deadline = time.monotonic() + 10
            while not idle(http.get("/metrics").text):
                assert time.monotonic() < deadline, "aborted requests still run"
                time.sleep(0.1)
            # the replicas' steps stopped them: not all ran to their 500 tokens (LONG's max_tokens), the first
            # of which each took in its prefill step, so 499 in decode steps. How many each decoded first is
            # the time its abort took to reach its replica, which on a loaded host can be the whole request;
            # only requests never aborted decode all DROPPED x 499.
            assert decode_tokens(http) - decoded < DROPPED * 499, (decoded, decode_tokens(http))
    finally:
        assert srv.stop() == 0


def decode_tokens(http: httpx.Client) -> float:
    """Output tokens the replicas' steps computed (their summed step counter)."""
    m = re.search(r"^tokenmill:step_decode_tokens_total\{[^}]*\} (\S+)$", http.get("/metrics").text, re.M)
    assert m is not None
    return float(m.group(1))


def idle(metrics: str) -> bool:
    """No request in flight on any replica, none running in the engines (their summed gauge)."""
    running = re.findall(r"^tokenmill:(?:data_parallel_requests_running|num_requests_running)\{[^}]*\} (\S+)$",
                         metrics, re.M)
    return len(running) == 3 and all(float(v) == 0 for v in running)


def test_a_dead_replica_ends_its_requests_and_the_other_serves(llama_dir: str) -> None:
    # one sequence at a time per replica: each holds five long streams, most of them still waiting when
    # replica 0 is killed (five, and the C++ kernels off: with the fused decode step all three once ended before
    # the kill)
    srv = RemoteServer(llama_dir, "--data-parallel-size", "2", "--max-num-seqs", "1", "--no-cpu-kernels")
    try:
        pids = replica_pids(srv)
        with ThreadPoolExecutor(10) as pool, srv.client() as http:
            started = threading.Event()
            opened = [threading.Event() for _ in range(10)]  # every stream in the engine before the kill
            streams = [pool.submit(stream_lines, srv, LONG, opened=o, started=started.set) for o in opened]
            assert started.wait(30), "no stream started"
            assert all(o.wait(30) for o in opened), "not every stream was accepted"
            os.kill(pids[0], signal.SIGKILL)
            results = [s.result(30) for s in streams]
            failed = [lines for lines in results if "error" in lines[-2]]
            assert failed, "no request was in flight on the dead replica"
            for lines in failed:
                assert_stream_error(lines)
                assert "data-parallel replica 0 of 2" in lines[-2], lines[-2]
            for lines in results:
                if lines not in failed:
                    assert lines[-1] == "data: [DONE]" and '"finish_reason":"length"' in lines[-2], lines[-2:]
            health = http.get("/health")
            assert health.status_code == 503 and "data-parallel replica 0 of 2" in health.text, health.text
            r = http.post("/v1/completions", json={"prompt": "def main():", "max_tokens": 4})
            assert r.status_code == 200, r.text  # replica 1 serves on
            assert 'tokenmill:data_parallel_replica_up{replica="0"} 0.0' in http.get("/metrics").text
        assert srv.proc.poll() is None
    finally:
        srv.stop()


def test_stats_sum_as_one_engine() -> None:
    a = SchedulerStats(num_running=2, kv_cache_usage=0.5, num_total_blocks=100, prefix_cache_hits=10,
                       spec_num_accepted_tokens_per_pos=[3, 1], step=StepStats(steps=5, last_step_s=0.1),
                       structured_requests={"json": 2})
    b = SchedulerStats(num_running=1, kv_cache_usage=0.25, num_total_blocks=300, prefix_cache_hits=4,
                       spec_num_accepted_tokens_per_pos=[2], step=StepStats(steps=7, last_step_s=0.3),
                       structured_requests={"json": 1, "regex": 4})
    merged = merge_stats([a, b], latest=1)
    assert merged.num_running == 3 and merged.num_total_blocks == 400 and merged.prefix_cache_hits == 14
    assert merged.kv_cache_usage == pytest.approx((50 + 75) / 400)
    assert merged.spec_num_accepted_tokens_per_pos == [5, 1]
    assert merged.structured_requests == {"json": 3, "regex": 4}
    assert merged.step == StepStats(steps=12, last_step_s=0.3)
    assert merge_stats([a, None], latest=0) == a


def test_offline_llm_runs_one_replica(llama_dir: str) -> None:
    with pytest.raises(ValueError, match="runs under `tokenmill serve --data-parallel-size N`"):
        LLM(llama_dir, data_parallel_size=2)
    with pytest.raises(ValueError, match="data_parallel_size must be an integer >= 1, got 0"):
        LLM(llama_dir, data_parallel_size=0)


def test_bad_sizes_are_one_line_at_start(llama_dir: str) -> None:
    assert_one_line_error(serve(llama_dir, "--port", str(free_port()), "--data-parallel-size", "0"),
                          "data_parallel_size must be an integer >= 1, got 0")
