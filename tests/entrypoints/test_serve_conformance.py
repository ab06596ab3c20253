"""What real clients send and call, against `tokenmill serve` with the `openai` client: OpenAI's
request fields that do not apply (accepted, ignored, logged once), request ids echoed, /ping and
/v1/models/{id}, vLLM's truncate_prompt_tokens, allowed_token_ids and bad_words, and a request
that fans out into more sequences than --max-prompts-per-request allows."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.entrypoints.server import RemoteServer

GREEDY: dict[str, Any] = {"temperature": 0.0}


@pytest.fixture(scope="module")
def server(llama_dir: str) -> Iterator[RemoteServer]:
    srv = RemoteServer(llama_dir)  # no --served-model-name, no queue limit: the defaults
    yield srv
    assert srv.stop() is not None


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def token_id(server: RemoteServer, text: str) -> int:
    [tid] = httpx.post(f"{server.url}/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
    return int(tid)


def test_fan_out_is_bounded(server: RemoteServer) -> None:
    """The issue's 220 KB body: 20,000 prompts x n=4 once queued 80,000 sequences."""
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": [[5, 6, 7]] * 20000, "n": 4}, timeout=60)
    assert r.status_code == 400, r.text[:200]
    err = r.json()["error"]
    assert err["code"] == "too_many_sequences" and "--max-prompts-per-request" in err["message"]
    assert "80000" in err["message"] and "256" in err["message"]
    ok = httpx.post(f"{server.url}/v1/completions", json={"prompt": [[5, 6, 7]] * 64, "n": 4, "max_tokens": 1},
                    timeout=120)
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 256  # the default limit itself


def test_openai_fields_that_do_not_apply_are_ignored(server: RemoteServer, client: openai.OpenAI, model: str) -> None:
    kwargs: dict[str, Any] = dict(
        model=model, messages=[{"role": "user", "content": "hi"}], max_completion_tokens=3, metadata={"team": "a"},
        store=False, user="u-1", service_tier="auto", reasoning_effort="low", parallel_tool_calls=False,
        prediction={"type": "content", "content": "hello"}, prompt_cache_key="k", safety_identifier="s",
        verbosity="low")
    for _ in range(2):
        out = client.chat.completions.create(**kwargs)
        assert out.choices[0].message.content is not None
    chunks = list(client.chat.completions.create(**kwargs, stream=True,
                                                 stream_options={"include_usage": True, "include_obfuscation": False}))
    assert chunks[-1].usage is not None
    assert client.completions.create(model=model, prompt="x", max_tokens=2, user="u-1").choices
    log = server.output()
    for name in ("metadata", "store", "user", "service_tier", "reasoning_effort"):
        assert log.count(f"request field {name!r} does not apply") == 1, name  # once per field per process
    assert "request field 'prediction' does not apply" not in log  # Predicted Outputs: drafted from (#19)


def test_request_ids_are_echoed(client: openai.OpenAI, model: str) -> None:
    raw = client.completions.with_raw_response.create(model=model, prompt="x", max_tokens=2,
                                                      extra_headers={"X-Request-Id": "trace-42"})
    assert raw.headers["x-request-id"] == "trace-42" and raw.parse().id == "cmpl-trace-42"
    raw = client.chat.completions.with_raw_response.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                           max_tokens=2, extra_body={"request_id": "body-7"})
    assert raw.headers["x-request-id"] == "body-7" and raw.parse().id == "chatcmpl-body-7"
    again = client.chat.completions.with_raw_response.create(  # a reused id is no conflict in the engine
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2, extra_body={"request_id": "body-7"})
    assert again.parse().id == "chatcmpl-body-7"
    raw = client.completions.with_raw_response.create(model=model, prompt="x", max_tokens=2)
    assert raw.parse().id == f"cmpl-{raw.headers['x-request-id']}"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt="x", max_tokens=2, extra_headers={"X-Request-Id": "a b"})


def test_ping_and_model_by_id(server: RemoteServer, client: openai.OpenAI, model: str, llama_dir: str) -> None:
    assert httpx.get(f"{server.url}/ping").status_code == 200
    assert httpx.post(f"{server.url}/ping").status_code == 200
    assert model == llama_dir  # the model argument as given
    card = client.models.retrieve(model)
    assert card.id == model and card.model_dump() == client.models.list().data[0].model_dump()
    r = httpx.get(f"{server.url}/v1/models/gpt-4")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_truncate_prompt_tokens_keeps_the_last_k(client: openai.OpenAI, model: str) -> None:
    long = [(7 * i) % 500 + 2 for i in range(600)]  # longer than max_model_len (512)
    cut = client.completions.create(model=model, prompt=long, max_tokens=6, extra_body={"truncate_prompt_tokens": 10},
                                    **GREEDY)
    tail = client.completions.create(model=model, prompt=long[-10:], max_tokens=6, **GREEDY)
    assert cut.usage is not None and cut.usage.prompt_tokens == 10
    assert cut.choices[0].text == tail.choices[0].text
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hello " * 300}],
                                          max_tokens=2, extra_body={"truncate_prompt_tokens": 20})
    assert chat.usage is not None and chat.usage.prompt_tokens == 20


def test_allowed_token_ids(server: RemoteServer, client: openai.OpenAI, model: str) -> None:
    allowed = [token_id(server, "def"), token_id(server, " self")]
    favoured = token_id(server, " in")  # a bias of +100 would make it every token, were it allowed
    for temperature in (0.0, 1.0):
        out = client.completions.create(model=model, prompt="x = 1", max_tokens=12, temperature=temperature, seed=3,
                                        logprobs=0, logit_bias={str(favoured): 100},
                                        extra_body={"allowed_token_ids": allowed, "ignore_eos": True})
        lp = out.choices[0].logprobs
        assert lp is not None and lp.tokens is not None and len(lp.tokens) == 12
        assert set(lp.tokens) <= {"def", " self"}, lp.tokens


def test_bad_words(server: RemoteServer, client: openai.OpenAI, model: str) -> None:
    banned = {token_id(server, "in"), token_id(server, " in")}
    bias = {str(t): 100 for t in banned}  # without the ban every token would be one of these
    biased = client.completions.create(model=model, prompt="x = 1", max_tokens=8, logprobs=0, logit_bias=bias, **GREEDY)
    assert biased.choices[0].logprobs is not None and set(biased.choices[0].logprobs.tokens or []) <= {"in", " in"}
    out = client.completions.create(model=model, prompt="x = 1", max_tokens=8, logprobs=0, logit_bias=bias,
                                    extra_body={"bad_words": ["in"], "ignore_eos": True}, **GREEDY)
    tokens = out.choices[0].logprobs.tokens if out.choices[0].logprobs else None
    assert tokens and not {"in", " in"} & set(tokens), tokens
    # a word of several tokens is banned where the output ends with the rest of it (tests/engine/test_bad_words.py)
    several = client.completions.create(model=model, prompt="x", max_tokens=2,
                                        extra_body={"bad_words": ["definitely not one token"]})
    assert several.choices[0].finish_reason is not None
