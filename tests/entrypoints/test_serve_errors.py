"""Every error is an OpenAI error object with the documented status and its stable code, and the
server stays healthy: 400 bad params (every number bounded, every string valid Unicode), 401 API
key, 404 model/route, 405, 413 body size (chunked too), 429 queue full, 400 for a fan-out past
the server's capacity."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.entrypoints.server import RemoteServer
from tokenmill.entrypoints.openai.errors import ERROR_CODES

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
    ("/v1/chat/completions", {"messages": MSG, "response_format": {"type": "json_schema"}}, 400,
     "response_format"),
    ("/v1/chat/completions", {"messages": MSG, "guided_json": {"type": "bogus"}}, 400, "guided_json"),
    ("/v1/completions", {"prompt": "x", "guided_choice": []}, 400, "guided_choice"),
    ("/v1/responses", {"input": "x", "tool_choice": {"type": "function", "name": ""}}, 400, "tool_choice.name"),
    ("/v1/chat/completions", {"messages": MSG, "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages.0.content.0.type"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
    ("/v1/chat/completions", {"messages": MSG, "max_completion_tokens": 10**6}, 400, "max_completion_tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": [10**6]}, 400, "tokens"),
    # every number is bounded (int64 where OpenAI and vLLM set no limit) before it reaches the engine
    ("/v1/completions", {"prompt": "x", "top_k": 2**63}, 400, "top_k"),
    ("/v1/completions", {"prompt": "x", "seed": 2**64}, 400, "seed"),
    ("/v1/completions", {"prompt": "x", "seed": -(2**63) - 1}, 400, "seed"),
    ("/v1/completions", {"prompt": "x", "priority": 2**64}, 400, "priority"),
    ("/v1/completions", {"prompt": "x", "n": 129}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2**63}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "min_tokens": 2**63}, 400, "min_tokens"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("/v1/chat/completions", {"messages": MSG, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "frequency_penalty": -3}, 400, "frequency_penalty"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"\u00b2": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"1" * 5000: 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens"),
    ("/v1/completions", {"prompt": "x", "request_id": "has space"}, 400, "request_id"),
    ("/v1/completions", {"prompt": "x", "allowed_token_ids": []}, 400, "allowed_token_ids"),
    ("/v1/completions", {"prompt": "x", "allowed_token_ids": [10**6]}, 400, "allowed_token_ids"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 1, "min_tokens": 600}, 400, "min_tokens"),
    ("/v1/chat/completions", {"messages": MSG, "max_completion_tokens": 5, "max_tokens": 600}, 400, "max_tokens"),
    # prompts x n past the server's capacity (max_num_seqs 4 + max_queue_len 4) can never be admitted
    ("/v1/completions", {"prompt": [[5, 6, 7]] * 3, "n": 4}, 400, "prompt"),
]

# sent as raw JSON: a lone surrogate ("\ud800" in JSON) and numbers Python's json module writes
# only as non-standard literals
RAW_CASES: list[tuple[str, str, str]] = [
    ("/v1/completions", '{"prompt": "\\ud800"}', "prompt"),
    ("/v1/completions", '{"prompt": ["ok", "x\\udfff"]}', "prompt"),
    ("/tokenize", '{"prompt": "\\ud800"}', "prompt"),
    ("/v1/completions", '{"prompt": "x", "stop": ["\\ud800"]}', "stop"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages.0.content"),
    ("/v1/completions", '{"model": "\\ud800", "prompt": "x"}', "model"),
    ("/v1/completions", '{"prompt": "x", "logit_bias": {"\\ud800": 1}}', "logit_bias"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": '
                             '{"\\ud800": 1}}', "chat_template_kwargs"),
    ("/v1/completions", '{"prompt": "x", "\\ud800": 1}', "\\ud800"),
    ("/v1/completions", '{"prompt": "x", "temperature": Infinity}', "temperature"),
    ("/v1/completions", '{"prompt": "x", "temperature": 1e309}', "temperature"),
    ("/v1/completions", '{"prompt": "x", "top_p": NaN}', "top_p"),
    ("/v1/completions", '{"prompt": "x", "logit_bias": {"5": -Infinity}}', "logit_bias"),
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
    assert ERROR_CODES.get(err["code"]) == status, err  # one stable code per kind of error, from the table
    if param is not None:
        assert err["param"] == param, err
    return dict(err)


@pytest.mark.parametrize("path,body,status,param", CASES)
def test_bad_requests(http: httpx.Client, path: str, body: dict[str, Any], status: int, param: str | None) -> None:
    assert_error(http.post(path, json=body), status, param)


@pytest.mark.parametrize("path,raw,param", RAW_CASES)
def test_malformed_text_and_numbers(http: httpx.Client, path: str, raw: str, param: str) -> None:
    r = http.post(path, content=raw.encode(), headers={"content-type": "application/json"})
    assert_error(r, 400, param)


def test_overflowing_top_k_leaves_the_engine_serving(http: httpx.Client) -> None:
    """top_k 2**63 once overflowed the sampler's int64 tensor and killed the engine core."""
    assert_error(http.post("/v1/completions", json={"prompt": "x", "top_k": 2**63}), 400, "top_k")
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "top_k": 2**63 - 1})
    assert r.status_code == 200, r.text  # a top_k above the vocabulary means all of it


def test_int64_edges_are_accepted(server: RemoteServer) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)
    for seed in (2**63 - 1, -(2**63)):  # with n=2 the second sequence draws from seed + 1
        out = client.completions.create(model=client.models.list().data[0].id, prompt="x", max_tokens=2, seed=seed,
                                        n=2, extra_body={"priority": seed})
        assert [c.finish_reason for c in out.choices] == ["length", "length"]


def test_errors_keep_the_connection_usable(http: httpx.Client) -> None:
    assert_error(http.post("/v1/completions", json={"prompt": "x", "seed": 2**64}), 400)
    assert_error(http.post("/v1/completions", content=b'{"prompt": "\\ud800"}',
                           headers={"content-type": "application/json"}), 400)
    assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_chunked_body_over_the_limit(http: httpx.Client) -> None:
    def chunks(n: int, size: int) -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(n):
            yield b"x" * size
        yield b'", "max_tokens": 1}'

    # a generator body goes out with Transfer-Encoding: chunked, no Content-Length
    json_type = {"content-type": "application/json"}
    err = assert_error(http.post("/v1/completions", content=chunks(150, 1000), headers=json_type), 413)
    assert err["code"] == "payload_too_large"
    r = http.post("/v1/completions", content=chunks(3, 20), headers=json_type)  # under the limit: replayed whole
    assert r.status_code == 200, r.text


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
    assert_error(httpx.get(f"{server.url}/v1/models", headers={"Authorization": KEY}), 401)
    assert httpx.get(f"{server.url}/v1/models", headers=server.headers).status_code == 200
    for scheme in ("bearer", "BEARER"):  # the scheme is case-insensitive (RFC 9110)
        assert httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"{scheme} {KEY}"}).status_code == 200
    for path in ("/health", "/ping", "/metrics", "/version"):  # probes and monitoring need no key
        assert httpx.get(f"{server.url}{path}").status_code == 200, path
    for path in ("/docs", "/redoc", "/openapi.json"):  # the API's description is behind the key too
        assert_error(httpx.get(f"{server.url}{path}"), 401)
        assert httpx.get(f"{server.url}{path}", headers=server.headers).status_code == 200, path


def test_queue_full(server: RemoteServer, http: httpx.Client) -> None:
    # capacity = max_num_seqs 4 + max_queue_len 4 sequences
    err = assert_error(http.post("/v1/completions", json={"prompt": "x", "n": 9}), 400, "n")  # can never fit
    assert err["code"] == "too_many_sequences" and "--max-prompts-per-request" in err["message"]
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


def test_logprobs_of_tokens_a_constraint_rules_out_are_json(http: httpx.Client) -> None:
    """A grammar masks most of the vocabulary to -inf, which JSON cannot carry: the response holds
    vLLM's floor (-9999.0) in its place, not a 500."""
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "logprobs": 5, "guided_choice": ["ab"]})
    assert r.status_code == 200, r.text
    tops = r.json()["choices"][0]["logprobs"]["top_logprobs"]
    assert min(v for top in tops for v in top.values()) == -9999.0
