"""No request can hurt the server process: a request that fails admission gives its capacity back;
a dead engine core ends every request with an error and the server exits non-zero (so a supervisor
restarts it); SIGTERM drains the requests in flight for --shutdown-timeout seconds, then ends the
rest with an error."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from tests.entrypoints.server import RemoteServer

LONG = {"prompt": "x", "max_tokens": 500, "ignore_eos": True}


def post(server: RemoteServer, body: dict[str, Any]) -> httpx.Response:
    """json.dumps escapes what httpx's JSON encoding cannot send (a lone surrogate)."""
    with server.client() as http:
        return http.post("/v1/completions", content=json.dumps(body), headers={"content-type": "application/json"})


def stream_lines(server: RemoteServer, body: dict[str, Any], opened: threading.Event | None = None,
                 started: Callable[[], None] = lambda: None) -> list[str]:
    """The non-empty lines of a streamed completion. `opened` is set once the response starts (the
    engine has the request); `started` runs when the first line arrives."""
    lines: list[str] = []
    with server.client() as http, http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        if opened is not None:
            opened.set()
        for line in r.iter_lines():
            if line:
                lines.append(line)
                if len(lines) == 1:
                    started()
    return lines


def in_flight(server: RemoteServer) -> float:
    """HTTP requests the server is answering (from /metrics)."""
    text = httpx.get(f"{server.url}/metrics").text
    return sum(float(x.split()[-1]) for x in text.splitlines() if x.startswith("tokenmill:http_requests_in_flight{"))


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


@contextlib.contextmanager
def core_frozen(server: RemoteServer) -> Iterator[None]:
    """SIGSTOP the engine core: requests are admitted and wait, none can finish, whatever the timing."""
    os.kill(server.core_pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(server.core_pid, signal.SIGCONT)


def assert_503(r: httpx.Response) -> None:
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "server_error"


def assert_stream_error(lines: list[str]) -> None:
    """Ends with an OpenAI error event, then [DONE]."""
    assert lines[-1] == "data: [DONE]", lines[-3:]
    err = json.loads(lines[-2][len("data: "):])["error"]
    assert err["type"] == "server_error" and err["message"], err


def assert_completed(r: httpx.Response, tokens: int) -> None:
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == tokens and r.json()["choices"][0]["finish_reason"] == "length"


def assert_stream_completed(lines: list[str]) -> None:
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    assert all("error" not in e for e in events) and events[-1]["choices"][0]["finish_reason"] == "length"


def exit_code(server: RemoteServer, timeout: float) -> int:
    try:
        return server.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the server still runs {timeout}s later:\n{server.output()}") from None


def test_failed_admission_gives_back_its_capacity(llama_dir: str) -> None:
    """Requests that fail after admission counted them (not encodable for the engine core) are 400s
    and leave the capacity free: two of them once left an idle server answering 429 forever."""
    srv = RemoteServer(llama_dir, "--max-num-seqs", "2", "--max-queue-len", "0")
    try:
        for body in ({"prompt": "x", "stop": ["\ud800"]}, {"prompt": "x", "priority": 2**64},
                     {"prompt": "x", "stop": ["\udfff"]}):
            r = post(srv, body)
            assert r.status_code == 400, r.text
        with ThreadPoolExecutor(2) as pool:
            results = list(pool.map(lambda _: post(srv, {"prompt": "x", "max_tokens": 3, "ignore_eos": True}),
                                    range(2)))
        for r in results:
            assert_completed(r, 3)
    finally:
        assert srv.stop() == 0


def test_killed_core_ends_requests_and_the_server_exits(llama_dir: str) -> None:
    """kill -9 of the engine core: a stream in flight ends with an error event and [DONE], a plain
    request in flight gets a 503 error object, and the API process exits non-zero within seconds."""
    srv = RemoteServer(llama_dir)
    try:
        with ThreadPoolExecutor(2) as pool:
            started = threading.Event()
            stream = pool.submit(stream_lines, srv, LONG, started=started.set)
            assert started.wait(10), "the stream never started"
            with core_frozen(srv):
                plain = pool.submit(post, srv, LONG)
                wait_for(lambda: in_flight(srv) == 2, 10, "the requests never reached the server")
                os.kill(srv.core_pid, signal.SIGKILL)
                killed = time.monotonic()
            assert_stream_error(stream.result(10))
            assert_503(plain.result(10))
        assert exit_code(srv, 10) != 0 and time.monotonic() - killed < 10
        assert "engine core" in srv.output()
    finally:
        srv.stop()


def test_sigterm_drains_requests_in_flight(llama_dir: str) -> None:
    """SIGTERM: requests in flight run to the end, new ones get 503 meanwhile, and the exit is 0."""
    srv = RemoteServer(llama_dir, "--max-num-seqs", "1", "--shutdown-timeout", "60")
    try:
        with ThreadPoolExecutor(3) as pool:
            with core_frozen(srv):
                posts = [pool.submit(post, srv, LONG) for _ in range(2)]
                stream = pool.submit(stream_lines, srv, LONG)
                wait_for(lambda: in_flight(srv) == 3, 10, "the requests never reached the server")
                srv.proc.send_signal(signal.SIGTERM)
                wait_for(lambda: httpx.get(f"{srv.url}/health").status_code == 503, 5, "/health never turned 503")
                assert_503(post(srv, {"prompt": "too late"}))
                assert in_flight(srv) == 3
            for f in posts:
                assert_completed(f.result(30), 500)
            assert_stream_completed(stream.result(30))
        assert exit_code(srv, 10) == 0
    finally:
        srv.stop()


def test_sigterm_ends_what_outlasts_the_shutdown_timeout(llama_dir: str) -> None:
    """Past --shutdown-timeout each request still in flight ends with a 503 error object or an SSE
    error event and [DONE] (never a plain-text 500 or a cut stream), and the exit status is 3."""
    srv = RemoteServer(llama_dir, "--shutdown-timeout", "1")
    try:
        with ThreadPoolExecutor(4) as pool:
            with core_frozen(srv):  # nothing can finish before the deadline
                posts = [pool.submit(post, srv, LONG) for _ in range(2)]
                streams = [pool.submit(stream_lines, srv, LONG) for _ in range(2)]
                wait_for(lambda: in_flight(srv) == 4, 10, "the requests never reached the server")
                signalled = time.monotonic()
                srv.proc.send_signal(signal.SIGTERM)
                for f in posts:
                    assert_503(f.result(10))
                for f in streams:
                    assert_stream_error(f.result(10))
                assert time.monotonic() - signalled >= 1  # they were given the whole timeout
        assert exit_code(srv, 10) == 3
        assert time.monotonic() - signalled < 10
    finally:
        srv.stop()


def test_a_second_signal_ends_the_drain_at_once(llama_dir: str) -> None:
    """A second SIGTERM / Ctrl-C does not wait for --shutdown-timeout: the requests end now, exit 3."""
    srv = RemoteServer(llama_dir, "--shutdown-timeout", "60")
    try:
        with ThreadPoolExecutor(1) as pool:
            with core_frozen(srv):
                plain = pool.submit(post, srv, LONG)
                wait_for(lambda: in_flight(srv) == 1, 10, "the request never reached the server")
                srv.proc.send_signal(signal.SIGTERM)
                wait_for(lambda: httpx.get(f"{srv.url}/health").status_code == 503, 5, "/health never turned 503")
                srv.proc.send_signal(signal.SIGINT)  # Ctrl-C, the second time
                r = plain.result(10)
                assert_503(r)
                assert "second stop signal" in r.json()["error"]["message"]
        assert exit_code(srv, 15) == 3
    finally:
        srv.stop()
