"""Every error is an OpenAI error object with the documented status, and the server stays
healthy: 400 bad params, 401 API key, 404 model/route, 405, 413 body size, 429 queue full."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.entrypoints.server import RemoteServer

KEY = "sk-errors"
MSG = [{"role": "user", "content": "hi"}]

CASES: list[tuple[str, dict[str, Any], int, str | None]] = [
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 2.0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "3"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": [[]]}, 400, "prompt"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": [5] * 600}, 400, "prompt"),
    ("/v1/completions", {"prompt": [5] * 10, "max_tokens": 600}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": [10**6]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, 400, "suffix"),
    ("/v1/completions", {"prompt": "x", "bogus": 1}, 400, "bogus"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [10**6]}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"100000": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"-3": 1}}, 400, "logit_bias"),
    ("/v1/chat/completions", {"messages": MSG, "stop_token_ids": [10**6]}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "seed": 2**70}, 400, "seed"),
    ("/v1/completions", {"prompt": "x", "stream": True, "min_tokens": 20, "max_tokens": 10}, 400, "min_tokens"),
    ("/v1/completions", {}, 400, "prompt"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}]},
     400, "tools"),
    ("/v1/chat/completions", {"messages": MSG, "response_format": {"type": "json_object"}}, 400,
     "response_format"),
    ("/v1/chat/completions", {"messages": MSG, "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages.0.content.0.type"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
    ("/v1/chat/completions", {"messages": MSG, "max_completion_tokens": 10**6}, 400, "max_completion_tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": [10**6]}, 400, "tokens"),
]


@pytest.fixture(scope="module")
def server(llama_dir: str) -> Iterator[RemoteServer]:
    srv = RemoteServer(llama_dir, "--max-num-seqs", "4", "--max-queue-len", "4", "--max-request-bytes", "100000",
                       api_key=KEY)
    yield srv
    assert srv.stop() is not None  # SIGTERM stops the server and its engine core


@pytest.fixture(scope="module")
def http(server: RemoteServer) -> Iterator[httpx.Client]:
    with server.client() as c:
        yield c


def assert_error(r: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return dict(err)


@pytest.mark.parametrize("path,body,status,param", CASES)
def test_bad_requests(http: httpx.Client, path: str, body: dict[str, Any], status: int, param: str | None) -> None:
    assert_error(http.post(path, json=body), status, param)


def test_malformed_routes_and_bodies(server: RemoteServer, http: httpx.Client) -> None:
    assert_error(http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"}),
                 400)
    assert_error(http.post("/v1/completions", json=["a list"]), 400)
    assert_error(http.get("/v1/nothing-here"), 404)
    assert_error(http.get("/v1/completions"), 405)
    assert_error(http.post("/v1/completions", json={"prompt": "x" * 200_000}), 413)


def test_api_key(server: RemoteServer) -> None:
    assert_error(httpx.get(f"{server.url}/v1/models"), 401)
    assert_error(httpx.get(f"{server.url}/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
    assert httpx.get(f"{server.url}/v1/models", headers=server.headers).status_code == 200
    assert httpx.get(f"{server.url}/health").status_code == 200  # probes need no key


def test_queue_full(server: RemoteServer, http: httpx.Client) -> None:
    # capacity = max_num_seqs 4 + max_queue_len 4 sequences
    assert_error(http.post("/v1/completions", json={"prompt": "x", "n": 9}), 400, "n")  # can never fit
    body = {"prompt": "x", "n": 8, "max_tokens": 480, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # kept: dropping the iterator would close the stream (a disconnect)
        assert next(lines).startswith('data: {"id"')
        assert_error(http.post("/v1/completions", json={"prompt": "x"}), 429)
    deadline = time.monotonic() + 10  # the server notices the hang-up and frees the capacity
    while (r := http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})).status_code == 429:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert r.status_code == 200


def test_healthy_after_errors(server: RemoteServer, http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    r = http.post("/v1/completions", json={"prompt": "still fine", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
