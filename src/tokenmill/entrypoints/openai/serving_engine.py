"""What the completion and chat endpoints share: model and length checks, SamplingParams from
a request, submitting to the engine with the right HTTP errors, merging per-prompt streams,
and guarding a request against client disconnects and the server's timeout."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from starlette.requests import Request

from tokenmill.core.messages import KVTransferParams
from tokenmill.core.request import PriorityClass
from tokenmill.engine.async_engine import AsyncLLM, EngineDeadError, QueueFullError, RequestFailedError, RequestStream
from tokenmill.engine.input_processor import KVSharing, ProcessedPrompt, resolve_max_tokens
from tokenmill.entrypoints.openai.errors import APIError, bad_request
from tokenmill.entrypoints.openai.grammar_library import GrammarLibrary
from tokenmill.entrypoints.openai.middleware import BATCH_SCOPE_KEY
from tokenmill.entrypoints.openai.protocol import PromptLogprob, SamplingRequest
from tokenmill.entrypoints.openai.request_types import IGNORED_FIELDS, REQUEST_ID_PATTERN
from tokenmill.entrypoints.openai.serving_tools import STRUCTURED_OUTPUT_FIELDS, structured_outputs_of
from tokenmill.outputs import PositionLogprobs, RequestOutput
from tokenmill.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from tokenmill.structured_outputs_config import LIBRARY_MODULES

logger = logging.getLogger(__name__)
T = TypeVar("T")
_TOKEN_ID_KEY = re.compile(r"-?[0-9]{1,19}")  # a logit_bias key; int() of a long or non-ASCII digit string fails
_REQUEST_ID = re.compile(REQUEST_ID_PATTERN)
REQUEST_ID_HEADER = "X-Request-Id"


@dataclass
class ServerContext:
    engine: AsyncLLM
    model_name: str  # reported in responses and /v1/models
    model_aliases: frozenset[str]  # other names requests may use (the path, its basename)
    chat_template: str | None = None
    request_timeout: float | None = None
    model_root: str | None = None  # the model argument as given, shown as /v1/models' root
    max_sequences_per_request: int | None = None  # prompts x n; None: no limit
    warned_fields: set[str] = field(default_factory=set)  # ignored request fields already logged
    tool_call_parser: str | None = None  # --tool-call-parser
    enable_auto_tool_choice: bool = False  # --enable-auto-tool-choice
    grammar: GrammarLibrary = field(default_factory=GrammarLibrary)


# request fields that can carry a constraint the API process checks with the grammar library: the
# structured-output fields, tools (required or named tool_choice) and the Responses API's text format
CONSTRAINT_FIELDS = (*STRUCTURED_OUTPUT_FIELDS, "tools", "text")


def engine_dead(error: EngineDeadError) -> APIError:
    return APIError("engine_dead", f"the engine is not available: {error}")


@dataclass
class RequestIds:
    response_id: str  # the response's "id": prefix + the client's id (X-Request-Id or request_id) or a uuid
    engine_id: str  # unique in the engine even when clients reuse an id
    header: str  # echoed as X-Request-Id


class OpenAIServing:
    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx
        self.engine = ctx.engine
        self.tokenizer = ctx.engine.tokenizer
        self.max_model_len = ctx.engine.config.model.max_model_len

    @property
    def grammar_backend(self) -> str:
        """The engine's (--structured-outputs-config), which checks requests' constraints."""
        return str(self.engine.config.structured_outputs.backend)

    @property
    def vocab_size(self) -> int:
        return int(self.engine.config.model.arch.vocab_size)

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.ctx.model_name and name not in self.ctx.model_aliases:
            raise APIError("model_not_found", f"The model `{name}` does not exist.", "model")

    async def constraints_ready(self, req: Any) -> None:
        """Waits for the grammar library when the request may carry a constraint (a structured-output
        field or tools), so that checking it does not import the library on the event loop."""
        if any(getattr(req, name, None) is not None for name in CONSTRAINT_FIELDS):
            await self.ctx.grammar.ready(self.engine.prepare_structured_output, LIBRARY_MODULES[self.grammar_backend])

    def check_request(self, req: SamplingRequest, num_prompts: int) -> None:
        """What every generate request checks first: the model, the fan-out, fields that do not apply."""
        self.check_model(req.model)
        for name in ("max_tokens", "max_completion_tokens", "min_tokens"):  # each, even when another overrides it
            value = getattr(req, name, None)
            if value is not None and value >= self.max_model_len:
                raise bad_request(f"{name} is {value}, but this model's maximum context length is "
                                  f"{self.max_model_len} tokens, prompt included", name, "context_length_exceeded")
        limit = self.ctx.max_sequences_per_request
        if limit is not None and num_prompts * req.n > limit:
            raise bad_request(f"this request asks for {num_prompts * req.n} sequences ({num_prompts} prompt(s) x "
                              f"n={req.n}); this server allows at most {limit} per request "
                              "(--max-prompts-per-request)", "prompt" if num_prompts > 1 else "n",
                              "too_many_sequences")
        for name in sorted(IGNORED_FIELDS & req.model_fields_set - self.ctx.warned_fields):
            self.ctx.warned_fields.add(name)
            logger.warning("request field %r does not apply to tokenmill and is ignored", name)

    def request_ids(self, raw: Request, req: SamplingRequest, prefix: str) -> RequestIds:
        client_id = raw.headers.get(REQUEST_ID_HEADER)
        if client_id is not None and not _REQUEST_ID.match(client_id):
            raise bad_request(f"{REQUEST_ID_HEADER} must be 1 to 128 visible ASCII characters", REQUEST_ID_HEADER)
        client_id = client_id or req.request_id
        if client_id is None:
            own = uuid.uuid4().hex
            return RequestIds(f"{prefix}-{own}", f"{prefix}-{own}", own)
        return RequestIds(f"{prefix}-{client_id}", f"{prefix}-{client_id}-{uuid.uuid4().hex[:8]}", client_id)

    def tokenize_text(self, text: str, add_special_tokens: bool = True, param: str = "prompt") -> list[int]:
        try:
            return [int(t) for t in self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]]
        except Exception as e:  # the tokenizer's own errors (its types vary by tokenizer)
            raise bad_request(f"cannot tokenize {param}: {e}", param) from None

    def tokenize(self, prompt: str | list[int], add_special_tokens: bool = True, param: str = "prompt",
                 truncate: int | None = None) -> ProcessedPrompt:
        """Token ids checked against the vocabulary and max_model_len; `truncate` keeps the last k."""
        text = prompt if isinstance(prompt, str) else None
        ids = self.tokenize_text(prompt, add_special_tokens, param) if isinstance(prompt, str) else list(prompt)
        if truncate is not None and len(ids) > truncate:
            ids, text = ids[-truncate:], None
        if len(ids) >= self.max_model_len:
            raise bad_request(f"This model's maximum context length is {self.max_model_len} tokens. However, "
                              f"{param} has {len(ids)} tokens (and at least one must be generated). Please "
                              "reduce its length (or set truncate_prompt_tokens).", param, "context_length_exceeded")
        try:
            return self.engine.input_processor.tokenize({"prompt": text, "prompt_token_ids": ids})
        except ValueError as e:
            raise bad_request(str(e), param) from None

    def max_tokens(self, prompt_len: int, requested: int | None, param: str = "max_tokens") -> int:
        try:
            return resolve_max_tokens(prompt_len, requested, self.max_model_len, must_fit=True, name=param)
        except ValueError as e:
            code = "invalid_value" if requested is not None and requested < 1 else "context_length_exceeded"
            raise bad_request(str(e), param, code) from None

    def sampling_params(self, req: SamplingRequest, max_tokens: int, logprobs: int | None = None,
                        prompt_logprobs: int | None = None, stream: bool = False,
                        constraint: StructuredOutputsParams | None = None) -> SamplingParams:
        structured, field_name = structured_outputs_of(req, self.grammar_backend)
        if structured is not None and constraint is not None:
            raise bad_request(f"{field_name} cannot be combined with a tool_choice that calls a tool", field_name)
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
                logit_bias=self._logit_bias(req), bad_words_token_ids=self._bad_words(req),
                skip_special_tokens=req.skip_special_tokens,
                include_stop_str_in_output=req.include_stop_str_in_output,
                output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
                structured_outputs=structured or constraint)
        except ValueError as e:
            word = str(e).split(" ", 1)[0]
            raise bad_request(str(e), word if word in type(req).model_fields else None) from None

    def _logit_bias(self, req: SamplingRequest) -> dict[int, float]:
        """logit_bias, with allowed_token_ids and bad_words as bans (-inf) on the other tokens."""
        bias: dict[int, float] = {}
        for key, value in (req.logit_bias or {}).items():
            if not _TOKEN_ID_KEY.fullmatch(key):
                raise bad_request(f"logit_bias keys must be integer token ids, got {key!r}", "logit_bias")
            bias[int(key)] = value  # in the vocabulary: checked by the engine's InputProcessor on submit
        if req.allowed_token_ids is not None:
            allowed = set(req.allowed_token_ids)
            if max(allowed) >= self.vocab_size:
                raise bad_request(f"allowed_token_ids has token id {max(allowed)}, out of vocabulary (valid ids "
                                  f"are 0..{self.vocab_size - 1})", "allowed_token_ids")
            bias.update((t, -math.inf) for t in range(self.vocab_size) if t not in allowed)
        return bias

    def _bad_words(self, req: SamplingRequest) -> list[list[int]]:
        """Each bad word as token ids, at the start of a text and after a space (vLLM's two spellings)."""
        words: list[list[int]] = []
        for word in req.bad_words or []:
            for spelling in dict.fromkeys((word.lstrip(), " " + word.lstrip())):
                tokens = self.tokenize_text(spelling, add_special_tokens=False, param="bad_words")
                if tokens and tokens not in words:
                    words.append(tokens)
        return words

    def kv_transfer_params(self, req: SamplingRequest, num_prompts: int) -> KVTransferParams | None:
        """A request's `kv_transfer_params`, checked against this server's `--kv-transfer-config` role (a 400
        that says what is wrong); None where it asks for no transfer."""
        raw = req.kv_transfer_params
        if raw is None:
            return None
        produce, consume = raw.get("do_remote_decode") is True, raw.get("do_remote_prefill") is True
        if not produce and not consume:
            return None
        field_name = "kv_transfer_params"
        role = self.engine.config.kv_transfer
        if produce and consume:
            raise bad_request("kv_transfer_params: do_remote_decode and do_remote_prefill exclude each other",
                              field_name)
        if role is None or (produce and not role.is_producer) or (consume and not role.is_consumer):
            need = "kv_producer" if produce else "kv_consumer"
            raise bad_request(f"kv_transfer_params: this server is not a KV {need.split('_')[1]} (start it with "
                              f"--kv-transfer-config '{{\"kv_role\": \"{need}\"}}' or kv_both)", field_name)
        if num_prompts != 1 or req.n != 1 or req.prompt_logprobs is not None or getattr(req, "use_beam_search", False):
            raise bad_request("kv_transfer_params: a disaggregated request has one prompt, n=1, no prompt_logprobs "
                              "and no beam search", field_name)
        if produce:
            if req.stream:
                raise bad_request("kv_transfer_params: do_remote_decode answers once; send stream false", "stream")
            return KVTransferParams(do_remote_decode=True)
        host, port, remote = raw.get("remote_host"), raw.get("remote_port"), raw.get("remote_request_id")
        if not isinstance(host, str) or not host or not isinstance(remote, str) or not remote:
            raise bad_request("kv_transfer_params: do_remote_prefill needs remote_host and remote_request_id "
                              "(strings, from the producer's answer)", field_name)
        if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
            raise bad_request(f"kv_transfer_params: remote_port must be a TCP port, got {port!r}", field_name)
        return KVTransferParams(do_remote_prefill=True, remote_host=host, remote_port=port, remote_request_id=remote)

    def kv_transfer_answer(self, transfer: KVTransferParams | None, engine_id: str,
                           finish_reasons: list[str | None]) -> dict[str, Any] | None:
        """A producer's `kv_transfer_params` in its answer: where a consumer pulls the prompt's blocks."""
        role = self.engine.config.kv_transfer
        if transfer is None or not transfer.do_remote_decode or role is None:
            return None
        if not all(r in ("stop", "length") for r in finish_reasons):
            return None  # (the blocks are kept only for a request that finished)
        return {"do_remote_decode": False, "do_remote_prefill": True,
                "remote_engine_id": role.engine_id or f"{role.kv_ip}:{role.kv_port}", "remote_host": role.kv_ip,
                "remote_port": role.kv_port, "remote_request_id": engine_id, "remote_block_ids": None}

    def submit(self, prompts: list[ProcessedPrompt], params: list[SamplingParams], request_id: str,
               priority: int = 0, raw: Request | None = None,
               kv_transfer: KVTransferParams | None = None) -> list[RequestStream]:
        """All prompts or none: a failure aborts those already submitted. A request the batch runner
        sends (`raw`'s scope names its batch) runs in the batch priority class."""
        batch = raw.scope.get(BATCH_SCOPE_KEY) if raw is not None else None
        priority_class = PriorityClass.BATCH if batch else PriorityClass.INTERACTIVE
        streams: list[RequestStream] = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                streams.append(self.engine.add_request(
                    {"prompt": prompt.prompt, "prompt_token_ids": prompt.prompt_token_ids}, p, rid, priority,
                    priority_class, batch or "", KVSharing(transfer=kv_transfer) if kv_transfer else None))
        except BaseException as e:
            for s in streams:
                s.abort()
            if isinstance(e, QueueFullError):
                raise APIError("rate_limit_exceeded", str(e)) from None
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
            # a batch line waits on interactive traffic; its batch's completion_window bounds it instead
            timeout = None if BATCH_SCOPE_KEY in raw.scope else self.ctx.request_timeout
            done, _ = await asyncio.wait({task, watcher}, timeout=timeout,
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
            except (EngineDeadError, RequestFailedError) as e:
                raise api_error_of(e) from None
        if watcher in done:
            raise APIError("client_closed", "the client closed the connection")
        raise timed_out(self.ctx.request_timeout)


def _param_of(error: ValueError) -> str:
    """The request field an engine error is about: its first word when that is a sampling
    parameter (the engine's messages start with the field), else the prompt."""
    word = str(error).split(" ", 1)[0]
    return word if word in SamplingParams.__dataclass_fields__ else "prompt"


def request_failed(error: RequestFailedError) -> APIError:
    """The engine failed this request alone (a bug, not the input): a 500 that says so."""
    return APIError("request_failed", f"the engine failed this request: {error}")


def api_error_of(error: BaseException) -> APIError:
    """The OpenAI error for an exception a request ends with: its own where it is one, the engine's
    death (503) or this request's failure in the engine (500), else an internal error (a bug, logged)."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, EngineDeadError):
        return engine_dead(error)
    if isinstance(error, RequestFailedError):
        return request_failed(error)
    logger.error("unhandled error in a request", exc_info=error)
    return APIError("internal_error", f"internal server error: {type(error).__name__}")


def timed_out(timeout: float | None) -> APIError:
    return APIError("timeout", f"the request took longer than the server's timeout ({timeout}s) and was aborted")


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
            i, item = await _next_or_timeout(queue, deadline, timeout)
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


async def _next_or_timeout(queue: asyncio.Queue[T], deadline: float | None, timeout: float | None) -> T:
    """The queue's next item, else the request's timeout error at `deadline` (time.monotonic()). Not
    asyncio.wait_for: before Python 3.12 it drops a cancellation that lands as the item arrives, and a
    stream fed on every loop turn then runs on after its client left."""
    if not queue.empty():
        return queue.get_nowait()
    get = asyncio.ensure_future(queue.get())
    try:
        done, _ = await asyncio.wait({get}, timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
    finally:
        get.cancel()
    if not done:
        raise timed_out(timeout)
    return get.result()


async def collect_final(streams: list[RequestStream]) -> list[RequestOutput]:
    finals: list[Any] = [None] * len(streams)
    async for i, out in merge_streams(streams):
        finals[i] = out
    return finals


# the logprob JSON carries for a token the request's constraints ruled out (-inf is not JSON), as vLLM's
MIN_JSON_LOGPROB = -9999.0


def json_logprob(value: float) -> float:
    return max(value, MIN_JSON_LOGPROB)


def prompt_logprobs_json(entries: list[PositionLogprobs | None],
                         token_text: Callable[[int, PositionLogprobs], str]) -> list[dict[str, PromptLogprob] | None]:
    """vLLM's `prompt_logprobs`: per prompt position None (the first) or {token id: its logprob, rank and
    text} for the actual token and the top k."""
    return [None if entry is None else
            {str(t): PromptLogprob(logprob=json_logprob(e.logprob), rank=e.rank, decoded_token=token_text(t, entry))
             for t, e in entry.items()} for entry in entries]


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"


async def sse_stream(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """Server-sent events ending in [DONE]; a failure mid-stream becomes an error event."""
    error: APIError | None = None
    try:
        async for payload in events:
            yield sse(payload)
    except Exception as e:  # a bug too: the stream still ends as the client expects
        error = api_error_of(e)
    if error is not None:
        yield sse(error.body().model_dump_json())
    yield sse("[DONE]")
