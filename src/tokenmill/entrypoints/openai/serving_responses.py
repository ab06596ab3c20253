"""OpenAI's Responses API: POST /v1/responses (a string or message items, instructions,
previous_response_id, streaming as typed SSE events), GET and DELETE /v1/responses/{id}; function tools
(tool_choice, function_call and function_call_output items) and structured output (`text.format`
json_schema or json_object) as the chat endpoint serves them (serving_tools.py).

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
from fastapi.responses import JSONResponse
from pydantic import (
    BaseModel,
    ConfigDict,
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
from tokenmill.entrypoints.openai.request_types import INTEGRAL, NonEmptyStr, OpenAIRequest, token_count
from tokenmill.entrypoints.openai.serving_chat import OpenAIServingChat
from tokenmill.entrypoints.openai.serving_engine import (
    OpenAIServing,
    ServerContext,
    api_error_of,
    collect_final,
    merge_streams,
)
from tokenmill.entrypoints.openai.serving_tools import ToolCallStream, ToolPlan, answer, plan_tools
from tokenmill.entrypoints.openai.tool_protocol import (
    ChatTool,
    FunctionDefinition,
    FunctionName,
    NamedToolChoice,
    ToolCallFunction,
    ToolCallRequest,
)
from tokenmill.entrypoints.streaming import AbortingStreamingResponse

logger = logging.getLogger(__name__)

MAX_STORED_RESPONSES = 1024
# Responses fields tokenmill does not implement: accepted only with a value that asks for nothing.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "truncation": (None, "disabled"), "reasoning": (None,),
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


class FunctionCallItem(OpenAIRequest):
    """A call the model made (in the output, and sent back as input)."""
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(OpenAIRequest):
    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


class ResponsesFunctionTool(OpenAIRequest):
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def chat_tool(self) -> ChatTool:
        return ChatTool(function=FunctionDefinition(name=self.name, description=self.description,
                                                    parameters=self.parameters, strict=self.strict))


class ResponsesNamedChoice(OpenAIRequest):
    type: Literal["function"]
    name: NonEmptyStr


class TextFormat(OpenAIRequest):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    model_config = ConfigDict(populate_by_name=True)


class TextConfig(OpenAIRequest):
    format: TextFormat | None = None
    verbosity: str | None = None


InputItem = InputMessage | FunctionCallItem | FunctionCallOutputItem  # a message's "type" may be left out


class ResponsesRequest(OpenAIRequest):
    checks_unicode: ClassVar[bool] = True
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: Annotated[int, token_count(1), INTEGRAL] | None = None
    temperature: float | None = Field(None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    stream: bool | None = False
    store: bool | None = True
    metadata: dict[_Key, _Value] | None = Field(None, max_length=16)
    user: str | None = None
    tools: list[ResponsesFunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesNamedChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None

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
        tools = data.get("tools")
        if isinstance(tools, list) and any(not isinstance(t, dict) or t.get("type") != "function" for t in tools):
            raise PydanticCustomError("unsupported_field", "only function tools are supported by tokenmill "
                                      "('{field}')", {"field": "tools"})
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


class OutputFunctionCall(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


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
    output: list[OutputMessage | OutputFunctionCall] = Field(default_factory=list)
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
    parallel_tool_calls: bool = True
    tool_choice: Any = "auto"
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
    item: OutputMessage | OutputFunctionCall | None = None
    arguments: str | None = None
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
    plan: ToolPlan


class OpenAIServingResponses(OpenAIServing):
    def __init__(self, ctx: ServerContext, store: ResponseStore) -> None:
        super().__init__(ctx)
        self.chat = OpenAIServingChat(ctx)
        self.store = store

    async def create(self, req: ResponsesRequest, raw: Request) -> Response:
        self.check_model(req.model)
        await self.constraints_ready(req)
        job = self._prepare(req)
        max_tokens = self.max_tokens(len(job.prompt.prompt_token_ids), req.max_output_tokens, "max_output_tokens")
        fmt = req.text.format if req.text is not None else None
        response_format = None if fmt is None or fmt.type == "text" else {"type": fmt.type} if (
            fmt.type == "json_object") else {"type": "json_schema", "json_schema": {
                "name": fmt.name or "response", "schema": fmt.json_schema, "strict": fmt.strict}}
        try:
            sampling = SamplingRequest.model_validate({"temperature": req.temperature, "top_p": req.top_p,
                                                       "response_format": response_format})
        except ValidationError as e:
            raise bad_request(str(e), "text") from None
        try:
            params = self.sampling_params(sampling, max_tokens, stream=bool(req.stream), constraint=job.plan.constraint)
        except APIError as e:  # the chat endpoint's field is this one's text.format
            if e.param == "response_format":
                e.param, e.message = "text", e.message.replace("response_format", "text.format")
            raise
        streams = self.submit([job.prompt], [params], job.skeleton.id)
        if req.stream:
            return AbortingStreamingResponse(self._events(job, streams), media_type="text/event-stream")
        [final] = await self.guard(raw, collect_final(streams))
        comp = final.outputs[0]
        response = self._finish(job, comp.text, len(comp.token_ids), comp.finish_reason, final.num_cached_tokens)
        return JSONResponse(response.model_dump())

    def _prepare(self, req: ResponsesRequest) -> _Job:
        history: list[ChatMessage] = []
        if req.previous_response_id is not None:
            history = list(self.store.get(req.previous_response_id, "previous_response_id").conversation)
        items = [ChatMessage(role="user", content=req.input)] if isinstance(req.input, str) else _messages(req.input)
        conversation = history + items
        choice = req.tool_choice
        plan = plan_tools([t.chat_tool() for t in req.tools or []], NamedToolChoice(
            function=FunctionName(name=choice.name)) if isinstance(choice, ResponsesNamedChoice) else choice,
            req.parallel_tool_calls, self.ctx.tool_call_parser, self.ctx.enable_auto_tool_choice, self.grammar_backend)
        if not conversation:
            raise bad_request("input must have at least one message", "input")
        system = [ChatMessage(role="system", content=req.instructions)] if req.instructions else []
        try:
            prompt = self.chat.render(system + conversation, plan=plan)
        except APIError as e:
            e.param = "input" if e.param == "messages" else e.param  # the chat endpoint's name for it
            raise
        skeleton = ResponseObject(
            id=f"resp_{uuid.uuid4().hex}", created_at=int(time.time()), status="in_progress",
            model=self.ctx.model_name, instructions=req.instructions, previous_response_id=req.previous_response_id,
            max_output_tokens=req.max_output_tokens, temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, store=req.store is not False, metadata=req.metadata or {},
            user=req.user, tools=[t.model_dump(exclude_none=True) for t in req.tools or []],
            tool_choice=(choice.model_dump() if isinstance(choice, BaseModel) else choice) or (
                "auto" if req.tools else "none"), parallel_tool_calls=req.parallel_tool_calls is not False,
            text=req.text.model_dump(exclude_none=True, by_alias=True) if req.text is not None else {
                "format": {"type": "text"}})
        return _Job(req, conversation, prompt, skeleton, f"msg_{uuid.uuid4().hex}", plan)

    def _finish(self, job: _Job, text: str, output_tokens: int, finish_reason: str | None,
                cached_tokens: int) -> ResponseObject:
        """The final response, stored when the request asks for it."""
        complete = finish_reason != "length"
        n_input = len(job.prompt.prompt_token_ids)
        usage = ResponseUsage(input_tokens=n_input, output_tokens=output_tokens, total_tokens=n_input + output_tokens,
                              input_tokens_details=InputTokensDetails(cached_tokens=cached_tokens))
        status: Literal["completed", "incomplete"] = "completed" if complete else "incomplete"
        content, calls = answer(job.plan, text)
        output: list[OutputMessage | OutputFunctionCall] = []
        if content is not None or not calls:
            output.append(OutputMessage(id=job.item_id, status=status, content=[OutputText(text=content or "")]))
        output += [OutputFunctionCall(id=f"fc_{uuid.uuid4().hex}", call_id=c.id, name=c.function.name,
                                      arguments=c.function.arguments) for c in calls]
        response = job.skeleton.model_copy(update=dict(
            status=status, output=output, usage=usage,
            incomplete_details=None if complete else IncompleteDetails(reason="max_output_tokens")))
        if job.skeleton.store:
            said = ChatMessage(role="assistant", content=content, tool_calls=[ToolCallRequest(
                id=c.id, function=ToolCallFunction(name=c.function.name, arguments=c.function.arguments))
                for c in calls] or None)
            self.store.put(StoredResponse(response, [*job.conversation, said]))
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
        calls = ToolCallStream(job.plan)  # the text deltas carry the content only, never a call's text
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
                text += comp.text
                content, _ = calls.feed(comp.text, comp.finish_reason is not None)
                if content:
                    yield event("response.output_text.delta", delta=content, logprobs=[], **where)
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
        first = response.output[0]
        if isinstance(first, OutputMessage):
            yield event("response.output_text.done", text=first.content[0].text, logprobs=[], **where)
            yield event("response.content_part.done", part=first.content[0], **where)
        else:  # tool calls only: the message item opened for the text closes empty
            first = OutputMessage(id=job.item_id, status="completed", content=[])
        yield event("response.output_item.done", output_index=0, item=first)
        for i, call in enumerate(response.output[1:] if isinstance(response.output[0], OutputMessage)
                                 else response.output, start=1):
            assert isinstance(call, OutputFunctionCall)
            yield event("response.output_item.added", output_index=i, item=call.model_copy(update={
                "status": "in_progress", "arguments": ""}))
            yield event("response.function_call_arguments.delta", output_index=i, item_id=call.id,
                        delta=call.arguments)
            yield event("response.function_call_arguments.done", output_index=i, item_id=call.id,
                        arguments=call.arguments)
            yield event("response.output_item.done", output_index=i, item=call)
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


def _messages(items: list[InputMessage | FunctionCallItem | FunctionCallOutputItem]) -> list[ChatMessage]:
    """Input items as chat messages: function calls join the assistant message before them (or make one),
    their outputs are tool messages."""
    out: list[ChatMessage] = []
    for item in items:
        if isinstance(item, InputMessage):
            out.append(item.chat_message())
        elif isinstance(item, FunctionCallItem):
            call = ToolCallRequest(id=item.call_id, function=ToolCallFunction(name=item.name, arguments=item.arguments))
            if out and out[-1].role == "assistant":
                out[-1] = out[-1].model_copy(update={"tool_calls": [*(out[-1].tool_calls or []), call]})
            else:
                out.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        else:
            out.append(ChatMessage(role="tool", content=item.output, tool_call_id=item.call_id))
    return out


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI entries for the error statuses a route can answer, all in the OpenAI error schema."""
    return {code: {"model": ErrorResponse} for code in codes}
