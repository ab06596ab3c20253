"""/v1/responses without a server: the stored-response LRU, request validation, and the event
stream's ending when the engine fails mid-stream or the client goes away."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any, cast

import pytest
from pydantic import ValidationError

from tokenmill.engine.async_engine import EngineDeadError
from tokenmill.engine.input_processor import ProcessedPrompt
from tokenmill.entrypoints.openai.errors import APIError
from tokenmill.entrypoints.openai.protocol import ChatMessage
from tokenmill.entrypoints.openai.serving_responses import (
    OpenAIServingResponses,
    ResponseObject,
    ResponsesRequest,
    ResponseStore,
    StoredResponse,
    _Job,
)
from tokenmill.entrypoints.openai.serving_tools import ToolPlan
from tokenmill.outputs import CompletionOutput, RequestOutput


def stored(response_id: str) -> StoredResponse:
    response = ResponseObject(id=response_id, created_at=0, status="completed", model="m", temperature=1.0,
                              top_p=1.0, store=True)
    return StoredResponse(response, [ChatMessage(role="user", content="hi")])


def test_store_is_a_bounded_lru() -> None:
    store = ResponseStore(capacity=2)
    store.put(stored("a"))
    store.put(stored("b"))
    assert store.get("a").response.id == "a"  # now the most recently used
    store.put(stored("c"))
    with pytest.raises(APIError) as e:
        store.get("b")
    assert (e.value.status, e.value.code) == (404, "response_not_found")
    assert [store.get(k).response.id for k in ("a", "c")] == ["a", "c"]
    store.delete("a")
    with pytest.raises(APIError):
        store.delete("a")


def test_request_validation() -> None:
    req = ResponsesRequest.model_validate({"input": "x", "tools": [], "tool_choice": "auto", "store": None,
                                           "text": {"format": {"type": "text"}}, "truncation": "disabled"})
    assert req.store is None and req.stream is False
    for bad in ({"tools": [{"type": "web_search"}]}, {"background": True}, {"text": {"format": {"type": "json"}}},
                {"metadata": {str(i): "v" for i in range(17)}}, {"metadata": {"k": "v" * 513}}, {"user": "\ud800"},
                {"top_p": 0}, {"temperature": float("inf")}, {"input": [{"type": "function_call", "role": "user",
                                                                         "content": "x"}]}):
        with pytest.raises(ValidationError):
            ResponsesRequest.model_validate({"input": "x", **bad})


class FakeStream:
    """Yields the given outputs, then raises `error` (if any); records aborts."""

    def __init__(self, outputs: list[RequestOutput], error: BaseException | None = None) -> None:
        self.outputs = outputs
        self.error = error
        self.aborted = False

    async def _gen(self) -> AsyncIterator[RequestOutput]:
        for out in self.outputs:
            yield out
            await asyncio.sleep(0)
        if self.error is not None:
            raise self.error

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._gen()

    def abort(self) -> None:
        self.aborted = True


def serving_and_job() -> tuple[OpenAIServingResponses, _Job]:
    engine = SimpleNamespace(tokenizer=None, config=SimpleNamespace(model=SimpleNamespace(max_model_len=64)))
    ctx = SimpleNamespace(engine=engine, model_name="m", request_timeout=None)
    serving = OpenAIServingResponses(cast(Any, ctx), ResponseStore())
    req = ResponsesRequest.model_validate({"input": "hi"})
    skeleton = ResponseObject(id="resp_x", created_at=0, status="in_progress", model="m", temperature=1.0, top_p=1.0,
                              store=True)
    job = _Job(req, [ChatMessage(role="user", content="hi")], ProcessedPrompt(None, [1, 2, 3]), skeleton, "msg_x",
               ToolPlan())
    return serving, job


def delta(text: str) -> RequestOutput:
    return RequestOutput("r", None, [1, 2, 3], [CompletionOutput(index=0, text=text, token_ids=[7])], finished=False)


def events(frames: list[str]) -> list[dict[str, Any]]:
    parsed = []
    for frame in frames:
        head, data = frame.strip().split("\n")
        parsed.append(json.loads(data.removeprefix("data: ")))
        assert head == f"event: {parsed[-1]['type']}"
    return parsed


def test_stream_failure_ends_with_error_and_failed_events() -> None:
    serving, job = serving_and_job()
    stream = FakeStream([delta("ab")], EngineDeadError("the core died"))

    async def run() -> list[str]:
        return [f async for f in serving._events(job, cast(Any, [stream]))]

    got = events(asyncio.run(run()))
    assert [e["type"] for e in got][-3:] == ["response.output_text.delta", "error", "response.failed"]
    assert [e["sequence_number"] for e in got] == list(range(len(got)))
    assert got[-2]["code"] == "engine_dead" and "the core died" in got[-2]["message"] and "param" in got[-2]
    failed = got[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "engine_dead"
    assert stream.aborted
    with pytest.raises(APIError):
        serving.store.get("resp_x")  # only finished responses are stored


def test_stream_closed_early_aborts_the_request() -> None:
    serving, job = serving_and_job()
    stream = FakeStream([delta("a")] * 5)

    async def run() -> str:
        frames = serving._events(job, cast(Any, [stream]))
        first = await frames.__anext__()
        await frames.aclose()  # what Starlette does when the client hangs up
        return first

    assert asyncio.run(run()).startswith("event: response.created")
    assert stream.aborted
