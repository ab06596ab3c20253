"""OpenAI's Responses API for text: POST /v1/responses (a string or message items, instructions,
previous_response_id, streaming as typed SSE events), GET and DELETE /v1/responses/{id}.

The input goes through the chat endpoint's template. Stored responses (`store`, true by default)
live in a bounded in-memory LRU that belongs to the app: the oldest are dropped past its size and
none survive a restart."""

from __future__ import annotations

import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import (
    BaseModel,
    Field,
    SerializerFunctionWrapHandler,
    StringConstraints,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError
from starlette.requests import Request
from starlette.responses import Response

from tokenmill.engine.async_engine import RequestStream
from tokenmill.engine.input_processor import ProcessedPrompt
from tokenmill.entrypoints.openai.errors import APIError, bad_request
from tokenmill.entrypoints.openai.protocol import ChatMessage, ErrorResponse, SamplingRequest
from tokenmill.entrypoints.openai.request_types import INTEGRAL, OpenAIRequest, token_count
from tokenmill.entrypoints.openai.serving_chat import OpenAIServingChat
from tokenmill.entrypoints.openai.serving_engine import (
    OpenAIServing,
    ServerContext,
    api_error_of,
    collect_final,
    merge_streams,
)

logger = logging.getLogger(__name__)

MAX_STORED_RESPONSES = 1024
# Responses fields tokenmill does not implement: accepted only with a value that asks for nothing.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "tools": (None, []), "tool_choice": (None, "none", "auto"), "parallel_tool_calls": (None, True, False),
    "text": (None, {"format": {"type": "text"}}), "truncation": (None, "disabled"), "reasoning": (None,),
    "include": (None, []), "background": (None, False), "top_logprobs": (None, 0),
    "service_tier": (None, "auto", "default"),
}
_Key = Annotated[str, StringConstraints(max_length=64)]
_Value = Annotated[str, StringConstraints(max_length=512)]


# ---- request ------------------------------------------------------------------------------
class InputText(OpenAIRequest):
    type: Literal["input_text", "output_text"]  # output_text: an earlier response's output sent back
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class InputMessage(OpenAIRequest):
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[InputText]
    id: str | None = None
    status: str | None = None

    def chat_message(self) -> ChatMessage:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return ChatMessage(role=self.role, content=text)


class ResponsesRequest(OpenAIRequest):
    checks_unicode: ClassVar[bool] = True
    model: str | None = None
    input: str | list[InputMessage]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: Annotated[int, token_count(1), INTEGRAL] | None = None
    temperature: float | None = Field(None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    stream: bool | None = False
    store: bool | None = True
    metadata: dict[_Key, _Value] | None = Field(None, max_length=16)
    user: str | None = None

    @field_validator("metadata", "user")
    @classmethod
    def _encodable(cls, value: dict[str, str] | str | None) -> dict[str, str] | str | None:
        """Both are echoed back, and UTF-8 cannot hold a lone surrogate (a UnicodeEncodeError is a
        ValueError: a 400 that names the field)."""
        for text in [*value.keys(), *value.values()] if isinstance(value, dict) else [value or ""]:
            text.encode()
        return value

    @model_validator(mode="before")
    @classmethod
    def _reject_unimplemented(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for key in [k for k in data if k in _NEUTRAL]:
            if data[key] not in _NEUTRAL[key]:
                raise PydanticCustomError("unsupported_field", "'{field}' is not supported by tokenmill",
                                          {"field": key})
        return {k: v for k, v in data.items() if k not in _NEUTRAL}


# ---- response -----------------------------------------------------------------------------
class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class ResponseError(BaseModel):
    code: str
    message: str


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    model: str
    output: list[OutputMessage] = Field(default_factory=list)
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    temperature: float
    top_p: float
    store: bool
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None
    usage: ResponseUsage | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    parallel_tool_calls: bool = False
    tool_choice: Literal["none"] = "none"
    tools: list[Any] = Field(default_factory=list)
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    truncation: Literal["disabled"] = "disabled"


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True


class StreamEvent(BaseModel):
    """One SSE event; the fields other than type and sequence_number depend on the type."""
    type: str
    sequence_number: int = 0
    response: ResponseObject | None = None
    output_index: int | None = None
    item: OutputMessage | None = None
    item_id: str | None = None
    content_index: int | None = None
    part: OutputText | None = None
    delta: str | None = None
    text: str | None = None
    logprobs: list[Any] | None = None
    code: str | None = None
    message: str | None = None
    param: str | None = None

    @model_serializer(mode="wrap")
    def _drop_unused(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        keep = {"param"} if self.type == "error" else set()
        return {k: v for k, v in handler(self).items() if v is not None or k in keep}


# ---- serving ------------------------------------------------------------------------------
@dataclass
class StoredResponse:
    response: ResponseObject
    conversation: list[ChatMessage]  # what previous_response_id continues: input and output, no instructions


class ResponseStore:
    """A bounded LRU of stored responses; the least recently used goes first when full."""

    def __init__(self, capacity: int = MAX_STORED_RESPONSES) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, stored: StoredResponse) -> None:
        self._items[stored.response.id] = stored
        self._items.move_to_end(stored.response.id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        stored = self._items.get(response_id)
        if stored is None:
            raise APIError("response_not_found", f"No response found with id '{response_id}'.", param)
        self._items.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self._items[response_id]


@dataclass
class _Job:
    """One response being generated: the request, its conversation and prompt, and the shape
    every event repeats."""
    req: ResponsesRequest
    conversation: list[ChatMessage]
    prompt: ProcessedPrompt
    skeleton: ResponseObject
    item_id: str


class OpenAIServingResponses(OpenAIServing):
    def __init__(self, ctx: ServerContext, store: ResponseStore) -> None:
        super().__init__(ctx)
        self.chat = OpenAIServingChat(ctx)
        self.store = store

    async def create(self, req: ResponsesRequest, raw: Request) -> Response:
        self.check_model(req.model)
        job = self._prepare(req)
        max_tokens = self.max_tokens(len(job.prompt.prompt_token_ids), req.max_output_tokens, "max_output_tokens")
        try:
            sampling = SamplingRequest.model_validate({"temperature": req.temperature, "top_p": req.top_p})
        except ValidationError as e:
            raise bad_request(str(e)) from None
        params = self.sampling_params(sampling, max_tokens, stream=bool(req.stream))
        streams = self.submit([job.prompt], [params], job.skeleton.id)
        if req.stream:
            return StreamingResponse(self._events(job, streams), media_type="text/event-stream")
        [final] = await self.guard(raw, collect_final(streams))
        comp = final.outputs[0]
        response = self._finish(job, comp.text, len(comp.token_ids), comp.finish_reason, final.num_cached_tokens)
        return JSONResponse(response.model_dump())

    def _prepare(self, req: ResponsesRequest) -> _Job:
        history: list[ChatMessage] = []
        if req.previous_response_id is not None:
            history = list(self.store.get(req.previous_response_id, "previous_response_id").conversation)
        items = [ChatMessage(role="user", content=req.input)] if isinstance(req.input, str) else [
            m.chat_message() for m in req.input]
        conversation = history + items
        if not conversation:
            raise bad_request("input must have at least one message", "input")
        system = [ChatMessage(role="system", content=req.instructions)] if req.instructions else []
        try:
            prompt = self.chat.render(system + conversation)
        except APIError as e:
            e.param = "input" if e.param == "messages" else e.param  # the chat endpoint's name for it
            raise
        skeleton = ResponseObject(
            id=f"resp_{uuid.uuid4().hex}", created_at=int(time.time()), status="in_progress",
            model=self.ctx.model_name, instructions=req.instructions, previous_response_id=req.previous_response_id,
            max_output_tokens=req.max_output_tokens, temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, store=req.store is not False, metadata=req.metadata or {},
            user=req.user)
        return _Job(req, conversation, prompt, skeleton, f"msg_{uuid.uuid4().hex}")

    def _finish(self, job: _Job, text: str, output_tokens: int, finish_reason: str | None,
                cached_tokens: int) -> ResponseObject:
        """The final response, stored when the request asks for it."""
        complete = finish_reason != "length"
        n_input = len(job.prompt.prompt_token_ids)
        usage = ResponseUsage(input_tokens=n_input, output_tokens=output_tokens, total_tokens=n_input + output_tokens,
                              input_tokens_details=InputTokensDetails(cached_tokens=cached_tokens))
        status: Literal["completed", "incomplete"] = "completed" if complete else "incomplete"
        message = OutputMessage(id=job.item_id, status=status, content=[OutputText(text=text)])
        response = job.skeleton.model_copy(update=dict(
            status=status, output=[message], usage=usage,
            incomplete_details=None if complete else IncompleteDetails(reason="max_output_tokens")))
        if job.skeleton.store:
            self.store.put(StoredResponse(response, [*job.conversation, ChatMessage(role="assistant", content=text)]))
        return response

    async def _events(self, job: _Job, streams: list[RequestStream]) -> AsyncIterator[str]:
        """The documented event sequence; a failure mid-stream ends it with `error` and
        `response.failed` events."""
        seq = 0

        def event(type: str, **fields: Any) -> str:
            nonlocal seq
            data = StreamEvent(type=type, sequence_number=seq, **fields).model_dump_json()
            seq += 1
            return f"event: {type}\ndata: {data}\n\n"

        where = dict(item_id=job.item_id, output_index=0, content_index=0)
        text, tokens, cached, finish_reason = "", 0, 0, None
        try:
            yield event("response.created", response=job.skeleton)
            yield event("response.in_progress", response=job.skeleton)
            yield event("response.output_item.added", output_index=0,
                        item=OutputMessage(id=job.item_id, status="in_progress", content=[]))
            yield event("response.content_part.added", part=OutputText(text=""), **where)
            async for _, out in merge_streams(streams, self.ctx.request_timeout):
                comp = out.outputs[0]
                tokens += len(comp.token_ids)
                cached = max(cached, out.num_cached_tokens)
                finish_reason = comp.finish_reason or finish_reason
                if comp.text:
                    text += comp.text
                    yield event("response.output_text.delta", delta=comp.text, logprobs=[], **where)
        except Exception as e:
            error = api_error_of(e)
            yield event("error", code=error.code, message=error.message, param=error.param)
            failed = job.skeleton.model_copy(update=dict(
                status="failed", error=ResponseError(code=error.code or error.type, message=error.message)))
            yield event("response.failed", response=failed)
            return
        finally:  # a client gone before the first event never reaches merge_streams, which aborts on exit
            for s in streams:
                s.abort()
        response = self._finish(job, text, tokens, finish_reason, cached)
        yield event("response.output_text.done", text=text, logprobs=[], **where)
        yield event("response.content_part.done", part=response.output[0].content[0], **where)
        yield event("response.output_item.done", output_index=0, item=response.output[0])
        yield event(f"response.{response.status}", response=response)


def register(app: FastAPI, ctx: ServerContext, max_stored: int = MAX_STORED_RESPONSES) -> None:
    """Adds the /v1/responses routes to `app`, with a store of their own."""
    serving = OpenAIServingResponses(ctx, ResponseStore(max_stored))

    @app.post("/v1/responses", response_model=None, responses={
        200: {"model": ResponseObject, "content": {"text/event-stream": {}}}, **_errors(400, 401, 404, 408, 413, 429,
                                                                                          500, 503)})
    async def create_response(req: ResponsesRequest, raw: Request) -> Response:
        return await serving.create(req, raw)

    @app.get("/v1/responses/{response_id}", response_model=None,
             responses={200: {"model": ResponseObject}, **_errors(401, 404)})
    async def retrieve_response(response_id: str) -> JSONResponse:
        return JSONResponse(serving.store.get(response_id).response.model_dump())

    @app.delete("/v1/responses/{response_id}", response_model=None,
                responses={200: {"model": DeletedResponse}, **_errors(401, 404)})
    async def delete_response(response_id: str) -> JSONResponse:
        serving.store.delete(response_id)
        return JSONResponse(DeletedResponse(id=response_id).model_dump())


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI entries for the error statuses a route can answer, all in the OpenAI error schema."""
    return {code: {"model": ErrorResponse} for code in codes}
