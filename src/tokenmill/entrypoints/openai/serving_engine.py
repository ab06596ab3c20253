"""What the completion and chat endpoints share: model and length checks, SamplingParams from
a request, submitting to the engine with the right HTTP errors, merging per-prompt streams,
and guarding a request against client disconnects and the server's timeout."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

from starlette.requests import Request

from tokenmill.engine.async_engine import AsyncLLM, EngineDeadError, QueueFullError, RequestFailedError, RequestStream
from tokenmill.engine.input_processor import ProcessedPrompt, resolve_max_tokens
from tokenmill.entrypoints.openai.errors import APIError, bad_request
from tokenmill.entrypoints.openai.protocol import SamplingRequest
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import RequestOutputKind, SamplingParams

T = TypeVar("T")
_INT64 = 2**63


@dataclass
class ServerContext:
    engine: AsyncLLM
    model_name: str  # reported in responses and /v1/models
    model_aliases: frozenset[str]  # other names requests may use (the path, its basename)
    chat_template: str | None = None
    request_timeout: float | None = None


def engine_dead(error: EngineDeadError) -> APIError:
    return APIError(503, f"the engine is not available: {error}", type="server_error", code="engine_dead")


class OpenAIServing:
    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx
        self.engine = ctx.engine
        self.tokenizer = ctx.engine.tokenizer
        self.max_model_len = ctx.engine.config.model.max_model_len

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.ctx.model_name and name not in self.ctx.model_aliases:
            raise APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")

    def tokenize(self, prompt: str | list[int], add_special_tokens: bool = True,
                 param: str = "prompt") -> ProcessedPrompt:
        try:
            return self.engine.input_processor.tokenize(prompt, add_special_tokens)
        except ValueError as e:
            raise bad_request(str(e), param) from None

    def max_tokens(self, prompt_len: int, requested: int | None, param: str = "max_tokens") -> int:
        try:
            return resolve_max_tokens(prompt_len, requested, self.max_model_len, must_fit=True, name=param)
        except ValueError as e:
            raise bad_request(str(e), param) from None

    def sampling_params(self, req: SamplingRequest, max_tokens: int, logprobs: int | None = None,
                        prompt_logprobs: int | None = None, stream: bool = False) -> SamplingParams:
        bias: dict[int, float] = {}
        for key, value in (req.logit_bias or {}).items():
            if not key.lstrip("-").isdigit():
                raise bad_request(f"logit_bias keys must be integer token ids, got {key!r}", "logit_bias")
            bias[int(key)] = value  # in the vocabulary: checked by the engine's InputProcessor on submit
        if req.seed is not None and not -_INT64 <= req.seed < _INT64 - req.n:
            raise bad_request("seed must fit in a signed 64-bit integer", "seed")
        try:
            return SamplingParams(
                n=req.n, temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0,
                min_p=req.min_p or 0.0, seed=req.seed, max_tokens=max_tokens, min_tokens=req.min_tokens,
                stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
                stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos, logprobs=logprobs,
                prompt_logprobs=prompt_logprobs, presence_penalty=req.presence_penalty or 0.0,
                frequency_penalty=req.frequency_penalty or 0.0,
                repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
                logit_bias=bias, skip_special_tokens=req.skip_special_tokens,
                include_stop_str_in_output=req.include_stop_str_in_output,
                output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY)
        except ValueError as e:
            word = str(e).split(" ", 1)[0]
            raise bad_request(str(e), word if word in type(req).model_fields else None) from None

    def submit(self, prompts: list[ProcessedPrompt], params: list[SamplingParams], request_id: str,
               priority: int = 0) -> list[RequestStream]:
        """All prompts or none: a failure aborts those already submitted."""
        streams: list[RequestStream] = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                streams.append(self.engine.add_request(
                    {"prompt": prompt.prompt, "prompt_token_ids": prompt.prompt_token_ids}, p, rid, priority))
        except BaseException as e:
            for s in streams:
                s.abort()
            if isinstance(e, QueueFullError):
                raise APIError(429, str(e), type="rate_limit_error", code="queue_full") from None
            if isinstance(e, EngineDeadError):
                raise engine_dead(e) from None
            if isinstance(e, ValueError):
                raise bad_request(str(e), _param_of(e)) from None
            raise
        return streams

    async def guard(self, raw: Request, work: Awaitable[T]) -> T:
        """Runs `work` unless the client disconnects or the request times out first; either
        cancels it (which aborts its requests in the engine)."""
        task = asyncio.ensure_future(work)
        watcher = asyncio.ensure_future(_wait_disconnect(raw))
        try:
            done, _ = await asyncio.wait({task, watcher}, timeout=self.ctx.request_timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        if task in done:
            try:
                return task.result()
            except EngineDeadError as e:
                raise engine_dead(e) from None
            except RequestFailedError as e:
                raise request_failed(e) from None
        if watcher in done:
            raise APIError(499, "the client closed the connection", code="client_closed")
        raise timed_out(self.ctx.request_timeout)


def _param_of(error: ValueError) -> str:
    """The request field an engine error is about: its first word when that is a sampling
    parameter (the engine's messages start with the field), else the prompt."""
    word = str(error).split(" ", 1)[0]
    return word if word in SamplingParams.__dataclass_fields__ else "prompt"


def request_failed(error: RequestFailedError) -> APIError:
    """The engine failed this request alone (a bug, not the input): a 500 that says so."""
    return APIError(500, f"the engine failed this request: {error}", type="server_error", code="request_failed")


def timed_out(timeout: float | None) -> APIError:
    return APIError(408, f"the request took longer than the server's timeout ({timeout}s) and was aborted",
                    type="timeout_error", code="timeout")


async def _wait_disconnect(raw: Request) -> None:
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return


async def merge_streams(streams: list[RequestStream],
                        timeout: float | None = None) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from several streams as they come; aborts all on exit."""
    deadline = None if timeout is None else time.monotonic() + timeout
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
        except Exception as e:
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                i, item = await asyncio.wait_for(queue.get(), wait)
            except asyncio.TimeoutError:
                raise timed_out(timeout) from None
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.abort()


async def collect_final(streams: list[RequestStream]) -> list[RequestOutput]:
    finals: list[Any] = [None] * len(streams)
    async for i, out in merge_streams(streams):
        finals[i] = out
    return finals


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"


async def sse_stream(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """Server-sent events ending in [DONE]; a failure mid-stream becomes an error event."""
    error: APIError | None = None
    try:
        async for payload in events:
            yield sse(payload)
    except APIError as e:
        error = e
    except EngineDeadError as e:
        error = engine_dead(e)
    except RequestFailedError as e:
        error = request_failed(e)
    if error is not None:
        yield sse(error.body().model_dump_json())
    yield sse("[DONE]")
