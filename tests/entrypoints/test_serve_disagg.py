"""Disaggregated prefill and decode with real processes: a `tokenmill serve` KV producer, a KV consumer and
`tokenmill disagg-proxy` in front. Greedy answers through the proxy equal the consumer's own co-located
answers (completions and chat, streamed and not; the same long prefix twice, so prefix hits come on both
sides); a request whose blocks nobody pulls is freed on the producer; a producer killed before its consumer
pulls makes the consumer compute the prompt (same answer, every block free again); a dead decode instance
is a clear OpenAI error from the proxy, never a hang."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.entrypoints.server import RemoteServer, free_port
from tests.entrypoints.test_serve_cli import assert_one_line_error, serve

DEMO = str(Path(__file__).resolve().parents[2] / "models" / "tokenmill-demo")
NAME = "demo"
PREFIX = "The history of the lighthouse keepers of the northern coast is long and full of storms. " * 4


class ProxyProcess:
    def __init__(self, prefill: list[str], decode: list[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tokenmill.entrypoints.cli", "disagg-proxy", "--port", str(self.port),
             "--health-interval", "0.2", "--prefill", *prefill, "--decode", *decode],
            stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert self.proc.poll() is None, self.output()
            time.sleep(0.1)
        raise RuntimeError(self.output())

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def kv_server(role: str, **extra: float) -> tuple[RemoteServer, int]:
    port = free_port()
    config = {"kv_role": role, "kv_port": port, "kv_connector_extra_config": extra}
    return RemoteServer(DEMO, "--served-model-name", NAME, "--num-threads", "1", "--block-size", "16",
                        "--kv-transfer-config", json.dumps(config)), port


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[ProxyProcess, RemoteServer, RemoteServer]]:
    producer, _ = kv_server("kv_producer", hold_timeout_s=3)
    consumer = None
    proxy = None
    try:
        consumer, _ = kv_server("kv_consumer", transfer_timeout_s=5)
        proxy = ProxyProcess([producer.url], [consumer.url])
        yield proxy, producer, consumer
    finally:
        if proxy is not None:
            proxy.stop()
        for s in (producer, consumer):
            if s is not None and s.proc.poll() is None:
                s.stop()


def metric(server: RemoteServer, name: str, **labels: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"{re.escape(name)}\{{([^}}]*)\}} (\S+)$", line)
        if m and all(f'{k}="{v}"' in m.group(1) for k, v in labels.items()):
            total += float(m.group(2))
    return total


def wait_for(check: Any, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return bool(check())


def all_free(server: RemoteServer) -> bool:
    return (metric(server, "tokenmill:kv_cache_free_blocks") == metric(server, "tokenmill:kv_cache_total_blocks")
            and metric(server, "tokenmill:num_requests_running") == 0)


def ask(url: str, path: str, body: dict[str, Any]) -> tuple[str, httpx.Response | None]:
    """The answer's text (streamed answers put together)."""
    if not body.get("stream"):
        r = httpx.post(f"{url}{path}", json=body, timeout=120)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return (choice["text"] if "text" in choice else choice["message"]["content"]), r
    text = ""
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            for c in event["choices"]:
                text += c.get("text") or (c.get("delta") or {}).get("content") or ""
    return text, None


def body_for(path: str, tail: str, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": NAME, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": stream}
    if path == "/v1/completions":
        body["prompt"] = PREFIX + tail
    else:
        body["messages"] = [{"role": "user", "content": PREFIX + tail}]
    return body


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_through_the_proxy_equals_colocated(cluster: Any, path: str, stream: bool) -> None:
    proxy, producer, consumer = cluster
    for tail in (f"Question {path[-5:]} {stream}: who kept", f"Question {path[-5:]} {stream}: who rowed"):
        body = body_for(path, tail, stream)
        received = metric(consumer, "tokenmill:kv_transfer_bytes_total", direction="received")
        hits = metric(producer, "tokenmill:prefix_cache_hits_total")
        want, _ = ask(consumer.url, path, body)  # co-located: the consumer computes it all (and caches it)
        got, response = ask(proxy.url, path, body)
        assert got == want and got
        if response is not None:
            assert response.headers["x-tokenmill-prefill"] == producer.url
        # blocks came over (only those the consumer's own prefix cache lacked), and the producer's second
        # prompt of the pair hit the prefix its first one left
        assert metric(consumer, "tokenmill:kv_transfer_bytes_total", direction="received") > received
    assert metric(producer, "tokenmill:prefix_cache_hits_total") > hits
    assert metric(consumer, "tokenmill:kv_transfer_failures_total") == 0
    assert wait_for(lambda: all_free(producer)) and wait_for(lambda: all_free(consumer))


def test_bad_kv_transfer_params_are_400(cluster: Any) -> None:
    _, producer, consumer = cluster
    body = body_for("/v1/completions", "x", False)
    cases = [(producer, {"do_remote_prefill": True, "remote_host": "h", "remote_port": 1, "remote_request_id": "r"},
              "not a KV consumer"),
             (consumer, {"do_remote_decode": True}, "not a KV producer"),
             (consumer, {"do_remote_prefill": True, "remote_host": "h", "remote_port": 0, "remote_request_id": "r"},
              "remote_port"),
             (producer, {"do_remote_decode": True, "do_remote_prefill": True}, "exclude each other")]
    for server, params, message in cases:
        r = httpx.post(f"{server.url}/v1/completions", json={**body, "kv_transfer_params": params}, timeout=30)
        assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    r = httpx.post(f"{producer.url}/v1/completions",
                   json={**body, "stream": True, "kv_transfer_params": {"do_remote_decode": True}}, timeout=30)
    assert r.status_code == 400


def test_blocks_nobody_pulls_are_freed(cluster: Any) -> None:
    _, producer, _ = cluster
    body = {**body_for("/v1/completions", "unpulled", False), "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True}}
    r = httpx.post(f"{producer.url}/v1/completions", json=body, timeout=60)
    params = r.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_request_id"]
    assert not all_free(producer)  # kept for a consumer ...
    assert wait_for(lambda: all_free(producer), 15)  # ... until hold_timeout_s (3 s)


def test_producer_killed_consumer_computes_the_prompt(cluster: Any) -> None:
    proxy, producer, consumer = cluster
    body = body_for("/v1/completions", "Who lit the lamp?", False)
    r = httpx.post(f"{producer.url}/v1/completions",
                   json={**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}, timeout=60)
    params = r.json()["kv_transfer_params"]
    os.killpg(producer.proc.pid, signal.SIGKILL)  # the producer and its engine core, blocks unsent
    producer.proc.wait(10)
    failures = metric(consumer, "tokenmill:kv_transfer_failures_total")
    started = time.monotonic()
    got, _ = ask(consumer.url, "/v1/completions", {**body, "kv_transfer_params": params})
    assert time.monotonic() - started < 30
    assert metric(consumer, "tokenmill:kv_transfer_failures_total") == failures + 1
    want, _ = ask(consumer.url, "/v1/completions", body)
    assert got == want
    assert wait_for(lambda: all_free(consumer))
    # through the proxy: the prefill instance is gone, the decode instance computes it whole
    got, _ = ask(proxy.url, "/v1/completions", body)
    assert got == want


def test_dead_decode_instance_is_a_clear_error(cluster: Any) -> None:
    proxy, _, consumer = cluster
    os.killpg(consumer.proc.pid, signal.SIGKILL)
    consumer.proc.wait(10)
    r = httpx.post(f"{proxy.url}/v1/completions", json=body_for("/v1/completions", "anyone?", False), timeout=30)
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_workers", r.text


def test_serve_refuses_a_bad_kv_transfer_config(llama_dir: str) -> None:
    # (every refusal's wording: tests/engine/test_kv_transfer.py; here, that it is one line at start)
    config = '{"kv_role": "kv_both", "kv_connector": "LMCacheConnectorV1"}'
    assert_one_line_error(serve(llama_dir, "--port", str(free_port()), "--kv-transfer-config", config),
                          "lmcache", "not installed")


def test_serve_refuses_a_kv_port_in_use(llama_dir: str) -> None:
    with socket.socket() as s:
        port = free_port()
        s.bind(("127.0.0.1", port))
        s.listen()
        config = json.dumps({"kv_role": "kv_producer", "kv_port": port})
        assert_one_line_error(serve(llama_dir, "--port", str(free_port()), "--kv-transfer-config", config),
                              f"cannot listen on 127.0.0.1:{port}")
