"""`tokenmill router` in front of two real `tokenmill serve` replicas that register themselves: the
openai client through it, prefix affinity, and a replica killed under load."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.entrypoints.server import RemoteServer, free_port

DEMO = str(Path(__file__).resolve().parents[2] / "models" / "tokenmill-demo")
NAME = "demo"


class RouterProcess:
    def __init__(self, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tokenmill.entrypoints.cli", "router", "--port", str(self.port),
             "--health-interval", "0.2", *extra],
            stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                httpx.get(f"{self.url}/health", timeout=1)
                return
            except httpx.HTTPError:
                assert self.proc.poll() is None, self.output()
                time.sleep(0.1)
        raise RuntimeError(self.output())

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def healthy(self) -> list[str]:
        workers = httpx.get(f"{self.url}/health", timeout=5).json()["workers"]
        return sorted(w["url"] for w in workers if w["healthy"])

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[RouterProcess, list[RemoteServer]]]:
    router = RouterProcess()
    servers: list[RemoteServer] = []
    try:
        for _ in range(2):
            servers.append(RemoteServer(DEMO, "--served-model-name", NAME, "--register-with", router.url,
                                        "--num-threads", "1"))
        deadline = time.monotonic() + 30
        while len(router.healthy()) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert router.healthy() == sorted(s.url for s in servers), router.output()
        yield router, servers
    finally:
        for s in servers:
            if s.proc.poll() is None:
                s.stop()
        router.stop()


def test_openai_client_through_the_router_equals_a_replica(cluster: tuple[RouterProcess, list[RemoteServer]]) -> None:
    router, servers = cluster
    via = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused")
    direct = openai.OpenAI(base_url=f"{servers[0].url}/v1", api_key="unused")
    assert [m.id for m in via.models.list().data] == [NAME]
    kw = {"model": NAME, "prompt": "ROMEO.\n", "max_tokens": 12, "temperature": 0.0}
    assert via.completions.create(**kw).choices[0].text == direct.completions.create(**kw).choices[0].text
    streamed = "".join(c.choices[0].text for c in via.completions.create(**kw, stream=True) if c.choices)
    assert streamed == direct.completions.create(**kw).choices[0].text
    chat = {"model": NAME, "messages": [{"role": "user", "content": "Speak."}], "max_tokens": 8, "temperature": 0.0}
    assert (via.chat.completions.create(**chat).choices[0].message.content
            == direct.chat.completions.create(**chat).choices[0].message.content)
    # an error from the replica passes through as it was sent
    with pytest.raises(openai.BadRequestError) as err:
        via.completions.create(model=NAME, prompt="x", max_tokens=-1)
    assert err.value.body["code"] == "invalid_value"  # type: ignore[index]
    r = httpx.post(f"{router.url}/v1/completions", content=b"[1]", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"


def test_a_shared_prefix_goes_to_the_replica_that_holds_it(cluster: tuple[RouterProcess, list[RemoteServer]]) -> None:
    router, _ = cluster
    prefixes = [f"{name.upper()}.\n" + f"Thou art the {name} of all the world, " * 12 for name in ("king", "queen")]
    seen: dict[int, set[str]] = {0: set(), 1: set()}
    with httpx.Client(base_url=router.url, timeout=60) as client:
        for i in range(8):
            which = i % 2
            r = client.post("/v1/completions", json={"model": NAME, "prompt": prefixes[which] + f"user {i}:",
                                                     "max_tokens": 2})
            assert r.status_code == 200, r.text
            seen[which].add(r.headers["x-tokenmill-worker"])
    assert len(seen[0]) == 1 and len(seen[1]) == 1, seen  # each prefix stuck to one replica
    assert seen[0] != seen[1]  # and the two prefixes were spread over both
    metrics = httpx.get(f"{router.url}/metrics").text
    assert "tokenmill_router_prefix_routed_total 6.0" in metrics


def test_killing_a_replica_under_load_loses_no_non_streamed_request(
        cluster: tuple[RouterProcess, list[RemoteServer]]) -> None:
    router, servers = cluster
    victim = servers[1]

    def ask(i: int) -> tuple[int, str]:
        r = httpx.post(f"{router.url}/v1/completions", timeout=120,
                       json={"model": NAME, "prompt": f"{i} " * (20 + i), "max_tokens": 48, "ignore_eos": True})
        return r.status_code, r.headers.get("x-tokenmill-worker", "")

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(ask, i) for i in range(32)]
        time.sleep(0.5)
        os.killpg(victim.proc.pid, signal.SIGKILL)  # the server and its engine core
        results = [f.result(timeout=120) for f in futures]
    assert all(status == 200 for status, _ in results), results
    assert {w for _, w in results} <= {s.url for s in servers}
    deadline = time.monotonic() + 10
    while victim.url in router.healthy() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert router.healthy() == [servers[0].url]
    # streamed, after the death: still served by the survivor
    with httpx.stream("POST", f"{router.url}/v1/completions", timeout=60,
                      json={"model": NAME, "prompt": "KING.\n", "max_tokens": 4, "stream": True}) as r:
        body = r.read().decode()
    assert r.status_code == 200 and body.rstrip().endswith("data: [DONE]")
    victim.proc.wait(10)


def test_no_replica_is_a_503_in_the_error_schema() -> None:
    router = RouterProcess("--worker", f"http://127.0.0.1:{free_port()}")
    try:
        r = httpx.post(f"{router.url}/v1/completions", json={"model": NAME, "prompt": "x"}, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_workers"
        assert httpx.get(f"{router.url}/health").status_code == 503
    finally:
        router.stop()
