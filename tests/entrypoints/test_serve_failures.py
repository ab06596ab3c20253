"""Failures end cleanly: a core that cannot load its model fails the launch with a clear error;
a request past --request-timeout is aborted; SIGTERM stops both processes. (A killed core and
SIGTERM with requests in flight: test_serve_lifecycle.)"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import time
from collections.abc import Iterator

import httpx
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
    """Sequences running, as the core last reported; unknown (inf) before its first report."""
    lines = [x for x in http.get("/metrics").text.splitlines() if x.startswith("tokenmill:num_requests_running{")]
    return float(lines[0].split()[-1]) if lines else float("inf")


def test_sigterm_to_the_whole_process_group_stops_promptly(llama_dir: str) -> None:
    """What systemd (KillMode=control-group) or `kill -TERM -PGID` does: the core gets SIGTERM with
    the API process, leaves its end to the API process (which drains first), and both stop, with 0."""
    srv = RemoteServer(llama_dir)
    try:
        os.killpg(srv.proc.pid, signal.SIGTERM)  # the server runs in its own session
        assert srv.proc.wait(20) == 0
        assert not srv.core_alive()
    finally:
        srv.stop()
