"""Failures end cleanly: a core that cannot load its model fails the launch with a clear error;
a request past --request-timeout is aborted; a killed core turns /health to 503 within
seconds and ends in-flight requests with an error; SIGTERM stops both processes."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.entrypoints.server import RemoteServer
from tokenmill.config import EngineArgs
from tokenmill.engine.async_engine import AsyncLLM


@pytest.fixture(scope="module")
def server(llama_dir: str) -> Iterator[RemoteServer]:
    srv = RemoteServer(llama_dir, "--request-timeout", "0.1")  # far below 480 tokens of decode
    yield srv
    srv.stop()


def test_bad_model_fails_fast(llama_dir: str, tmp_path: str) -> None:
    broken = os.path.join(tmp_path, "broken")
    shutil.copytree(llama_dir, broken)
    with open(os.path.join(broken, "model.safetensors"), "wb") as f:
        f.write(b"\x00" * 4)
    args = EngineArgs(model=broken, kv_cache_memory="64MiB", max_model_len=512)
    started = time.monotonic()
    with pytest.raises(ValueError, match="engine core failed to start: .*safetensors"):
        asyncio.run(AsyncLLM.from_engine_args(args))
    assert time.monotonic() - started < 60


def test_request_timeout_aborts(server: RemoteServer) -> None:
    with server.client() as http:
        r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 480, "ignore_eos": True})
        assert r.status_code == 408 and r.json()["error"]["code"] == "timeout"
        body = {"prompt": "x", "max_tokens": 480, "ignore_eos": True, "stream": True}
        events = [line for line in http.post("/v1/completions", json=body).text.splitlines() if line]
        assert json.loads(events[-2][len("data: "):])["error"]["code"] == "timeout"
        assert events[-1] == "data: [DONE]"
        deadline = time.monotonic() + 10
        while running(http) > 0:
            assert time.monotonic() < deadline, "timed-out requests still run"
            time.sleep(0.1)


def running(http: httpx.Client) -> float:
    line = next(x for x in http.get("/metrics").text.splitlines() if x.startswith("tokenmill:num_requests_running{"))
    return float(line.split()[-1])


def test_killed_core_turns_health_503(server: RemoteServer) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=30)
    stream = client.completions.create(model=client.models.list().data[0].id, prompt="x", max_tokens=400,
                                       stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    os.kill(server.core_pid, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(openai.APIError):
        for _ in stream:
            pass
    while httpx.get(f"{server.url}/health").status_code != 503:
        assert time.monotonic() - started < 5
        time.sleep(0.1)
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"


def test_stop_with_dead_core_is_clean(server: RemoteServer) -> None:
    assert server.stop() is not None


def test_sigterm_to_the_whole_process_group_stops_promptly(llama_dir: str) -> None:
    """What systemd (KillMode=control-group) or `kill -TERM -PGID` does: the core gets SIGTERM with
    the API process and exits first; the API process's shutdown must not wait on it forever."""
    srv = RemoteServer(llama_dir)
    try:
        os.killpg(srv.proc.pid, signal.SIGTERM)  # the server runs in its own session
        srv.proc.wait(20)
        assert not srv.core_alive()
    finally:
        srv.stop()
