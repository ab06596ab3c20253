"""The clients users bring, against a real `tokenmill serve`: the `openai` SDK (completions, chat
and responses), LangChain's ChatOpenAI and LiteLLM, plain, streaming, batched and async.

The fixture model is random, so the tests check what each client parses (content strings, finish
reasons, usage counts, indices, event order), not the text. Nothing may leave 127.0.0.1: a guard
records every connection or name lookup for another host and the module fails if there was one."""

from __future__ import annotations

import asyncio
import json
import os
import socket
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.entrypoints.server import RemoteServer

KEY = "sk-clients"
NAME = "tiny"
MESSAGES: Any = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
_LOOPBACK = ("127.0.0.1", "localhost", "::1")
# no remote model-cost map, no telemetry or tracing from LiteLLM and LangChain
_OFFLINE_ENV = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_TELEMETRY": "False", "LANGSMITH_TRACING": "false",
                "LANGCHAIN_TRACING_V2": "false", "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module", autouse=True)
def loopback_only() -> Iterator[list[str]]:
    """Refuses (and records) connections and lookups for any host but loopback."""
    reached: list[str] = []
    real_connect, real_connect_ex, real_getaddrinfo = (socket.socket.connect, socket.socket.connect_ex,
                                                       socket.getaddrinfo)

    def check(host: Any) -> None:
        if isinstance(host, str) and host not in _LOOPBACK:
            reached.append(host)
            raise OSError(f"the client conformance tests reach only 127.0.0.1, not {host}")

    def connect(self: socket.socket, address: Any) -> None:
        if self.family != socket.AF_UNIX:
            check(address[0])
        real_connect(self, address)

    def connect_ex(self: socket.socket, address: Any) -> int:
        if self.family != socket.AF_UNIX:
            check(address[0])
        return real_connect_ex(self, address)

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        check(host.decode() if isinstance(host, bytes) else host)
        return real_getaddrinfo(host, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        for key, value in _OFFLINE_ENV.items():
            mp.setenv(key, value)
        mp.setattr(socket.socket, "connect", connect)
        mp.setattr(socket.socket, "connect_ex", connect_ex)
        mp.setattr(socket, "getaddrinfo", getaddrinfo)
        yield reached
    assert not reached, f"a client reached beyond loopback: {reached}"


@pytest.fixture(scope="module")
def server(llama_dir: str, loopback_only: list[str]) -> Iterator[RemoteServer]:
    srv = RemoteServer(llama_dir, "--served-model-name", NAME, "--max-num-seqs", "8", api_key=KEY)
    yield srv
    assert srv.stop() is not None


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)


def prompt_tokens(server: RemoteServer, messages: list[dict[str, str]]) -> int:
    with server.client() as http:
        return int(http.post("/tokenize", json={"messages": messages}).json()["count"])


# ---- openai: completions and chat ----------------------------------------------------------
def test_openai_completions(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(model=NAME, prompt="ROMEO.\n", max_tokens=6, n=2, seed=11, temperature=0.9,
                                  logprobs=2, stop=["\n\n"])
    a, b = client.completions.create(**kwargs), client.completions.create(**kwargs)
    assert a.object == "text_completion" and a.model == NAME and [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # the same seed
    assert a.usage is not None and a.usage.total_tokens == a.usage.prompt_tokens + a.usage.completion_tokens
    n_tokens = []
    for c in a.choices:
        assert isinstance(c.text, str) and c.finish_reason in ("stop", "length") and "\n\n" not in c.text
        assert c.logprobs is not None and c.logprobs.tokens is not None and c.logprobs.token_logprobs is not None
        n_tokens.append(len(c.logprobs.tokens))
        assert all(lp <= 0 for lp in c.logprobs.token_logprobs)
        assert c.finish_reason == "stop" or len(c.logprobs.tokens) == 6
    assert a.usage.completion_tokens == sum(n_tokens)
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    for c in a.choices:
        mine = [ch for chunk in chunks for ch in chunk.choices if ch.index == c.index]
        assert "".join(ch.text for ch in mine) == c.text
        assert [ch.finish_reason for ch in mine if ch.finish_reason] == [c.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage == a.usage


def test_openai_chat(client: openai.OpenAI, server: RemoteServer) -> None:
    kwargs: dict[str, Any] = dict(model=NAME, messages=MESSAGES, max_tokens=6, n=2, seed=5, temperature=0.9,
                                  logprobs=True, top_logprobs=2)
    full = client.chat.completions.create(**kwargs)
    assert full.object == "chat.completion" and [c.index for c in full.choices] == [0, 1]
    assert full.usage is not None and full.usage.prompt_tokens == prompt_tokens(server, MESSAGES)
    counts = []
    for c in full.choices:
        assert c.message.role == "assistant" and isinstance(c.message.content, str)
        assert c.finish_reason in ("stop", "length")
        assert c.logprobs is not None and c.logprobs.content is not None
        assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in c.logprobs.content)
        counts.append(len(c.logprobs.content))
    assert full.usage.completion_tokens == sum(counts)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    for c in full.choices:
        mine = [ch for chunk in chunks for ch in chunk.choices if ch.index == c.index]
        assert mine[0].delta.role == "assistant"
        assert "".join(ch.delta.content or "" for ch in mine) == c.message.content  # the same seed
        assert [ch.finish_reason for ch in mine if ch.finish_reason] == [c.finish_reason]
    assert chunks[-1].usage == full.usage


def test_openai_chat_stop_and_max_tokens(client: openai.OpenAI) -> None:
    greedy: dict[str, Any] = dict(model=NAME, messages=MESSAGES, temperature=0, max_tokens=24,
                                  extra_body={"ignore_eos": True})
    base = client.chat.completions.create(**greedy).choices[0]
    assert base.finish_reason == "length" and base.message.content
    text = base.message.content
    stop = next(text[i:i + 2] for i in range(4, len(text) - 2) if text[i:i + 2].strip() and "\ufffd" not in
                text[i:i + 2])
    cut = client.chat.completions.create(**greedy, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop" and cut.message.content == text[:text.index(stop)]


# ---- openai: responses ---------------------------------------------------------------------
def test_openai_responses_create_and_retrieve(client: openai.OpenAI, server: RemoteServer) -> None:
    r = client.responses.create(model=NAME, input="hello there", instructions="be brief", max_output_tokens=8,
                                temperature=0.8, top_p=0.9)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == NAME
    assert r.status in ("completed", "incomplete") and r.instructions == "be brief"
    assert (r.temperature, r.top_p, r.max_output_tokens) == (0.8, 0.9, 8)
    [item] = r.output
    assert item.type == "message" and item.role == "assistant" and item.status == r.status
    assert item.content[0].type == "output_text" and r.output_text == item.content[0].text
    assert r.usage is not None and r.usage.input_tokens == prompt_tokens(server, MESSAGES)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    if r.status == "incomplete":
        assert r.incomplete_details is not None and r.incomplete_details.reason == "max_output_tokens"
        assert r.usage.output_tokens == 8
    assert client.responses.retrieve(r.id) == r

    items: Any = [{"role": "user", "content": [{"type": "input_text", "text": "hello"}]}, *r.output,
                  {"type": "message", "role": "user", "content": "and then?"}]
    listed = client.responses.create(model=NAME, input=items, max_output_tokens=4)
    assert listed.usage is not None and listed.usage.input_tokens == prompt_tokens(server, [
        {"role": "user", "content": "hello"}, {"role": "assistant", "content": r.output_text},
        {"role": "user", "content": "and then?"}])
    follow = client.responses.create(model=NAME, input="and then?", previous_response_id=r.id, max_output_tokens=4)
    assert follow.previous_response_id == r.id and follow.usage is not None
    assert follow.usage.input_tokens == prompt_tokens(server, [  # the earlier instructions do not carry over
        {"role": "user", "content": "hello there"}, {"role": "assistant", "content": r.output_text},
        {"role": "user", "content": "and then?"}])


def test_openai_responses_stream(client: openai.OpenAI) -> None:
    events = list(client.responses.create(model=NAME, input="hello there", max_output_tokens=8, stream=True))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert set(types[4:-4]) <= {"response.output_text.delta"}
    final = events[-1]
    assert final.type in ("response.completed", "response.incomplete")
    response = final.response
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = events[-4]
    assert done.type == "response.output_text.done" and done.text == deltas == response.output_text
    assert events[0].type == "response.created" and events[0].response.status == "in_progress"
    assert response.status == final.type.split(".")[1] and response.id == events[0].response.id
    assert response.usage is not None and response.usage.output_tokens <= 8
    assert client.responses.retrieve(response.id) == response
    # the SDK's own accumulator checks every event's place in the sequence
    with client.responses.stream(model=NAME, input="hello there", max_output_tokens=4) as stream:
        seen = [e.type for e in stream]
    assert seen[0] == "response.created" and seen[-1] in ("response.completed", "response.incomplete")


def test_openai_responses_store_and_errors(client: openai.OpenAI, server: RemoteServer) -> None:
    unstored = client.responses.create(model=NAME, input="hi", max_output_tokens=2, store=False)
    for missing in (unstored.id, "resp_nope"):
        with pytest.raises(openai.NotFoundError) as e:
            client.responses.retrieve(missing)
        assert isinstance(e.value.body, dict) and e.value.body["code"] == "response_not_found"
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=NAME, input="hi", previous_response_id="resp_nope")
    stored = client.responses.create(model=NAME, input="hi", max_output_tokens=2)
    client.responses.delete(stored.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(stored.id)
    with server.client() as http:
        for body, param in [({"input": "x", "temperature": 3}, "temperature"),
                            ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
                            ({"input": "x", "max_output_tokens": 10**6}, "max_output_tokens"),
                            ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
                            ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
                             "input.0.content.0.type"),
                            ({"input": []}, "input"), ({"input": "\ud800"}, "input"),
                            ({"input": "x", "metadata": {"k": "\ud800"}}, "metadata.k"),
                            ({"input": "x", "bogus": 1}, "bogus")]:
            r = http.post("/v1/responses", content=json.dumps({"model": NAME, **body}),  # escapes surrogates
                          headers={"Content-Type": "application/json"})
            assert r.status_code == 400, (body, r.text)
            assert r.json()["error"]["param"] == param, (body, r.text)


# ---- LangChain -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chat_model(server: RemoteServer) -> Any:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(base_url=f"{server.url}/v1", api_key=KEY, model=NAME, max_tokens=6,
                      temperature=0.8, max_retries=0, timeout=60, stream_usage=True)


def check_ai_message(message: Any, max_tokens: int = 6) -> None:
    assert isinstance(message.content, str)
    assert message.response_metadata["finish_reason"] in ("stop", "length")
    usage = message.usage_metadata
    assert usage is not None and usage["input_tokens"] > 0 and 0 < usage["output_tokens"] <= max_tokens
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]


def test_langchain_invoke_stream_batch(chat_model: Any) -> None:
    from langchain_core.messages import HumanMessage, SystemMessage

    message = chat_model.invoke([SystemMessage("be brief"), HumanMessage("hello there")])
    check_ai_message(message)
    assert message.response_metadata["model_name"] == NAME
    chunks = list(chat_model.stream("hello there"))
    assert all(isinstance(c.content, str) for c in chunks)
    whole = chunks[0]
    for c in chunks[1:]:
        whole = whole + c
    check_ai_message(whole)
    answers = chat_model.batch(["one", "two", "three"])
    assert len(answers) == 3
    for a in answers:
        check_ai_message(a)


def test_langchain_over_the_responses_api(server: RemoteServer) -> None:
    from langchain_openai import ChatOpenAI

    model = ChatOpenAI(base_url=f"{server.url}/v1", api_key=KEY, model=NAME, max_tokens=6,
                       max_retries=0, timeout=60, use_responses_api=True)
    message = model.invoke("hello there")
    assert [block["type"] for block in message.content] == ["text"]
    assert message.response_metadata["status"] in ("completed", "incomplete")
    assert message.usage_metadata is not None and 0 < message.usage_metadata["output_tokens"] <= 6
    chunks = list(model.stream("hello there"))
    whole = chunks[0]
    for c in chunks[1:]:
        whole = whole + c
    assert "".join(block["text"] for block in whole.content) == whole.text
    assert whole.usage_metadata is not None and 0 < whole.usage_metadata["output_tokens"] <= 6


# ---- LiteLLM -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def litellm_args(server: RemoteServer) -> dict[str, Any]:
    import litellm

    litellm.telemetry = False
    return dict(model=f"openai/{NAME}", api_base=f"{server.url}/v1", api_key=KEY, messages=MESSAGES, max_tokens=6,
                temperature=0.8, seed=3, num_retries=0, timeout=60)


def test_litellm_completion(litellm_args: dict[str, Any], server: RemoteServer) -> None:
    import litellm

    r = litellm.completion(**litellm_args)
    choice = r.choices[0]
    assert isinstance(choice.message.content, str) and choice.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == prompt_tokens(server, MESSAGES)
    assert 0 < r.usage.completion_tokens <= 6
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    again = litellm.completion(**litellm_args, stream=True, stream_options={"include_usage": True})
    chunks = list(again)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content  # the same seed
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        choice.finish_reason]
    rebuilt = litellm.stream_chunk_builder(chunks)
    assert rebuilt is not None and rebuilt.usage.completion_tokens == r.usage.completion_tokens


def test_litellm_acompletion(litellm_args: dict[str, Any]) -> None:
    import litellm

    async def run() -> list[Any]:
        return list(await asyncio.gather(*[litellm.acompletion(**litellm_args) for _ in range(3)]))

    answers = asyncio.run(run())
    assert len({a.choices[0].message.content for a in answers}) == 1  # the same seed
    for a in answers:
        assert a.choices[0].finish_reason in ("stop", "length") and 0 < a.usage.completion_tokens <= 6


def test_litellm_responses(litellm_args: dict[str, Any]) -> None:
    import litellm

    args = {k: v for k, v in litellm_args.items() if k in ("model", "api_base", "api_key")}
    r = litellm.responses(**args, input="hello there", instructions="be brief", max_output_tokens=16)
    assert r.status in ("completed", "incomplete") and r.output[0].content[0].type == "output_text"
    assert r.usage is not None and 0 < r.usage.output_tokens <= 16


def test_no_client_left_loopback(loopback_only: list[str]) -> None:
    assert loopback_only == [] and os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] == "True"
    with pytest.raises(OSError, match="reach only 127.0.0.1"):  # the guard is in place (TEST-NET-1)
        socket.create_connection(("192.0.2.1", 80), timeout=1)
    loopback_only.clear()
