"""Structured output and tool calling over HTTP, with the real clients and each grammar backend: every
constrained answer of the random fixture model parses and validates (jsonschema) whole and streamed;
tool_choice required and named calls are valid JSON for the function's parameters; bad schemas are 400s;
the openai SDK's parse() and LangChain's bind_tools / with_structured_output work unmodified."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, Field

from tests.entrypoints.server import RemoteServer

NAME = "tiny"
PERSON = {"type": "object", "properties": {
    "kind": {"enum": ["cat", "dog", "bird"]}, "age": {"type": "integer", "minimum": 0, "maximum": 30},
    "ok": {"type": "boolean"}, "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
    "required": ["kind", "age", "ok", "tags"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"enum": ["Paris", "Oslo"]},
                                                "unit": {"enum": ["C", "F"]}}, "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}},
    "required": ["zone"]}}}
MSG = [{"role": "user", "content": "hello"}]


class Pet(BaseModel):
    kind: Literal["cat", "dog"]
    age: int = Field(ge=0, le=20)
    friendly: bool


@pytest.fixture(scope="module", params=["xgrammar", "guidance"])
def server(llama_dir: str, request: pytest.FixtureRequest) -> Iterator[RemoteServer]:
    """A server with each grammar backend: xgrammar by default, guidance by vLLM's flag."""
    backend = [] if request.param == "xgrammar" else ["--structured-outputs-config", '{"backend": "guidance"}']
    srv = RemoteServer(llama_dir, "--served-model-name", NAME, "--enable-auto-tool-choice",
                       "--tool-call-parser", "hermes", *backend)
    yield srv
    assert srv.stop() is not None


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)


def post(server: RemoteServer, path: str, body: dict[str, Any]) -> httpx.Response:
    with httpx.Client(timeout=120) as http:
        return http.post(f"{server.url}{path}", json={"model": NAME, **body})


def test_response_format_json_schema_whole_and_streamed(client: openai.OpenAI) -> None:
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    r = client.chat.completions.create(model=NAME, messages=MSG, n=3, temperature=1.0, seed=1, max_tokens=200,
                                       response_format=fmt)
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content or ""), PERSON)
    stream = client.chat.completions.create(model=NAME, messages=MSG, temperature=1.0, seed=2, max_tokens=200,
                                            response_format=fmt, stream=True)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), PERSON)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_json_object_and_vllm_extras(server: RemoteServer) -> None:
    r = post(server, "/v1/chat/completions", {"messages": MSG, "max_tokens": 300, "seed": 3,
                                              "response_format": {"type": "json_object"}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "stop":  # an open object may run past max_tokens; what there is is a prefix
        assert isinstance(json.loads(choice["message"]["content"]), dict)
    assert choice["message"]["content"].startswith("{")
    r = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 20, "n": 4, "temperature": 1.0, "seed": 4,
                                         "guided_choice": ["yes", "no", "maybe so"]})
    assert [c["text"] in ("yes", "no", "maybe so") for c in r.json()["choices"]] == [True] * 4
    r = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 20, "temperature": 1.0, "seed": 5,
                                         "guided_regex": "[0-9]{3}-[a-c]{2}"})
    assert r.json()["choices"][0]["text"][:3].isdigit() and len(r.json()["choices"][0]["text"]) == 6
    r = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 20, "temperature": 1.0, "seed": 6,
                                         "structured_outputs": {"grammar": 'root ::= "a" ("b" | "c")*  "!"'}})
    text = r.json()["choices"][0]["text"]
    assert text[0] == "a" and set(text[1:-1]) <= {"b", "c"}
    if r.json()["choices"][0]["finish_reason"] == "stop":
        assert text.endswith("!")
    r = post(server, "/v1/chat/completions", {"messages": MSG, "max_tokens": 200, "seed": 7,
                                              "structured_outputs": {"json": PERSON}, "stream": True})
    text = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content", "")
                   for line in r.text.splitlines() if line.startswith("data: {") and '"choices":[{' in line)
    jsonschema.validate(json.loads(text), PERSON)
    # /metrics counts the constrained requests by kind and the grammars compiled
    with server.client() as c:
        families = text_string_to_metric_families(c.get("/metrics").text)
        metrics = {(s.name, s.labels.get("kind")): s.value for family in families for s in family.samples}
    for kind, n in (("json_object", 1), ("choice", 4), ("regex", 1), ("grammar", 1), ("json", 1)):
        assert metrics[("tokenmill:structured_output_requests_total", kind)] >= n, kind
    assert metrics[("tokenmill:grammar_compilations_total", None)] >= 4  # the four kinds' grammars differ
    assert metrics[("tokenmill:grammar_compile_seconds_total", None)] > 0


@pytest.mark.parametrize(("body", "param", "says"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format", "invalid JSON schema"),
    ({"guided_regex": "a(b"}, "guided_regex", "invalid regex"),
    ({"guided_grammar": "root ::= missing"}, "guided_grammar", "invalid grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "at most one"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not in tools"),
])
def test_bad_constraints_are_400s(server: RemoteServer, body: dict[str, Any], param: str, says: str) -> None:
    r = post(server, "/v1/chat/completions", {"messages": MSG, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and says in r.json()["error"]["message"], r.text


def check_call(call: Any, tools: list[dict[str, Any]]) -> None:
    [tool] = [t for t in tools if t["function"]["name"] == call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    assert call.id and call.type == "function"


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_required_and_named_tool_calls_whole_and_streamed(client: openai.OpenAI, choice: Any) -> None:
    tools: Any = [WEATHER, TIME]
    r = client.chat.completions.create(model=NAME, messages=MSG, tools=tools, tool_choice=choice, n=2,
                                       temperature=1.0, seed=8, max_tokens=120, parallel_tool_calls=False)
    for c in r.choices:
        assert c.message.content is None and len(c.message.tool_calls or []) == 1
        for call in c.message.tool_calls or []:
            check_call(call, tools)
        if choice != "required":
            assert (c.message.tool_calls or [])[0].function.name == "get_time"
    stream = client.chat.completions.create(model=NAME, messages=MSG, tools=tools, tool_choice=choice,
                                            temperature=1.0, seed=9, max_tokens=120, stream=True)
    calls: dict[int, dict[str, Any]] = {}
    for chunk in stream:
        for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            entry = calls.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
            entry["name"] += (d.function and d.function.name) or ""
            entry["arguments"] += (d.function and d.function.arguments) or ""
    assert calls and all(c["id"] for c in calls.values())
    for c in calls.values():
        [tool] = [t for t in tools if t["function"]["name"] == c["name"]]
        jsonschema.validate(json.loads(c["arguments"]), tool["function"]["parameters"])


def test_tool_history_and_auto_choice(client: openai.OpenAI) -> None:
    history: Any = [
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"}]
    r = client.chat.completions.create(model=NAME, messages=history, tools=[WEATHER], max_tokens=8, seed=10)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    r = client.chat.completions.create(model=NAME, messages=history, tools=[WEATHER], tool_choice="none",
                                       max_tokens=8, seed=10)
    assert isinstance(r.choices[0].message.content, str) and not r.choices[0].message.tool_calls


def test_openai_sdk_parse(client: openai.OpenAI) -> None:
    r = client.chat.completions.parse(model=NAME, messages=MSG, response_format=Pet, max_tokens=200, seed=11)
    pet = r.choices[0].message.parsed
    assert isinstance(pet, Pet) and 0 <= pet.age <= 20


def test_langchain_bind_tools_and_with_structured_output(server: RemoteServer) -> None:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: Literal["Paris", "Oslo"], unit: Literal["C", "F"]) -> str:
        """The weather in a city."""
        return "sunny"

    model = ChatOpenAI(base_url=f"{server.url}/v1", api_key="x", model=NAME, max_tokens=150, temperature=1.0,
                       seed=12, max_retries=0, timeout=120)
    message = model.bind_tools([get_weather], tool_choice="get_weather").invoke("weather in Oslo?")
    assert len(message.tool_calls) == 1 and message.tool_calls[0]["name"] == "get_weather"
    assert message.tool_calls[0]["args"]["city"] in ("Paris", "Oslo")
    message = model.bind_tools([get_weather], tool_choice="any").invoke("weather?")
    assert message.tool_calls and message.tool_calls[0]["args"]["unit"] in ("C", "F")
    message = model.bind_tools([get_weather]).invoke("hi")  # auto: the hermes parser reads the text
    assert isinstance(message.content, str)
    for method in ("json_schema", "function_calling"):
        pet = model.with_structured_output(Pet, method=method).invoke("a pet, please")
        assert isinstance(pet, Pet), method


def flat(tool: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", **tool["function"]}


def test_responses_with_text_format_and_tools(client: openai.OpenAI) -> None:
    fmt: Any = {"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}}
    r = client.responses.create(model=NAME, input="a person", text=fmt, max_output_tokens=200, temperature=1.0)
    jsonschema.validate(json.loads(r.output_text), PERSON)
    assert r.text.format.type == "json_schema"
    events = list(client.responses.create(model=NAME, input="a person", text=fmt, max_output_tokens=200, stream=True))
    assert events[-1].type == "response.completed"
    jsonschema.validate(json.loads(events[-1].response.output_text), PERSON)
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == events[-1].response.output_text
    parsed = client.responses.parse(model=NAME, input="a pet", text_format=Pet, max_output_tokens=200)
    assert isinstance(parsed.output_parsed, Pet)
    tools: Any = [flat(WEATHER), flat(TIME)]
    r = client.responses.create(model=NAME, input="weather?", tools=tools, max_output_tokens=120,
                                tool_choice={"type": "function", "name": "get_weather"})
    [call] = [item for item in r.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER["function"]["parameters"])
    follow = client.responses.create(model=NAME, max_output_tokens=5, tools=tools, tool_choice="none", input=[
        {"type": "message", "role": "user", "content": "weather?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert follow.status in ("completed", "incomplete") and follow.output[0].type == "message"
    events = list(client.responses.create(model=NAME, input="time?", tools=tools, tool_choice="required",
                                          max_output_tokens=120, stream=True))
    done = [e.item for e in events if e.type == "response.output_item.done" and e.item.type == "function_call"]
    assert done and events[-1].type == "response.completed"
    for item in done:
        [tool] = [t for t in tools if t["name"] == item.name]
        jsonschema.validate(json.loads(item.arguments), tool["parameters"])
    assert not [e for e in events if e.type == "response.output_text.delta"]  # the call is no text
    auto = client.responses.create(model=NAME, input="weather?", tools=tools, max_output_tokens=8)
    assert auto.tool_choice == "auto" and auto.output and len(auto.tools) == 2  # the hermes parser read the text
    with pytest.raises(openai.BadRequestError, match="text.format cannot be combined") as err:
        client.responses.create(model=NAME, input="x", tools=tools, tool_choice="required", text=fmt)
    assert err.value.status_code == 400 and err.value.body["param"] == "text"  # type: ignore[index]


def torch_loaded(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return "libtorch" in f.read()


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads the API process's mappings from /proc")
def test_the_api_process_loads_the_grammar_library_at_the_first_constraint(llama_dir: str) -> None:
    # its 2 s import (torch with it) stays off the way to the first token and away from requests without one
    srv = RemoteServer(llama_dir, "--served-model-name", NAME)
    try:
        r = post(srv, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200, r.text
        time.sleep(1)
        assert not torch_loaded(srv.proc.pid)
        r = post(srv, "/v1/chat/completions", {"messages": MSG, "max_tokens": 40,
                                               "response_format": {"type": "json_object"}})
        assert r.status_code == 200, r.text
        assert torch_loaded(srv.proc.pid)
    finally:
        assert srv.stop() is not None
