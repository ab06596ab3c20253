"""AsyncLLM: the engine front end of the API process.

Tokenizes and validates requests (InputProcessor), sends them to the engine core process
(CoreClient), and routes the core's outputs, detokenized by the OutputProcessor, to one
asyncio queue per request from a single background task. Internally every request streams
DELTA outputs; a caller asking for CUMULATIVE or FINAL_ONLY gets them merged.

Admission is all or nothing: a request that fails anywhere on its way to the core (a value the
wire cannot carry, a failed send) leaves no queue, no counted sequences and no output state behind.
When the core dies every request in flight ends with EngineDeadError and `died` is set.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import replace
from typing import Any

from tokenmill.config import EngineArgs, EngineConfig
from tokenmill.core.messages import EngineCoreOutputs, SchedulerStats
from tokenmill.core.request import PriorityClass
from tokenmill.engine.core_client import CoreClient, EngineCoreClient
from tokenmill.engine.input_processor import InputProcessor, KVSharing, PromptType, load_tokenizer
from tokenmill.engine.llm_engine import child_requests
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.engine.wire import EngineDeadError
from tokenmill.metrics import EngineMetrics
from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

__all__ = ["AsyncLLM", "EngineDeadError", "QueueFullError", "RequestFailedError", "RequestStream",
           "ServerShutdownError"]

_INT64 = 2**63  # the wire's integers are signed 64-bit


class RequestFailedError(RuntimeError):
    """The engine could not prepare or sample this request (or its step failed); it alone ended."""


class QueueFullError(RuntimeError):
    """More sequences are queued than --max-queue-len allows."""


class ServerShutdownError(EngineDeadError):
    """The engine stopped serving because its server is shutting down: a request still in flight
    at the end of the drain ends with this (an EngineDeadError, so it is answered as one: 503)."""


class RequestStream:
    """Async iterator over one request's outputs. Cancelling a wait or calling `abort`
    aborts the request in the core (its KV blocks are freed at once)."""

    def __init__(self, engine: AsyncLLM, request_id: str, kind: RequestOutputKind,
                 queue: asyncio.Queue[RequestOutput | BaseException]) -> None:
        self.engine = engine
        self.request_id = request_id
        self.kind = kind
        self.queue = queue
        self.finished = False
        self._acc: RequestOutput | None = None

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        while not self.finished:
            try:
                item = await self.queue.get()
            except asyncio.CancelledError:
                self.abort()
                raise
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            failure = next((c.stop_reason for c in item.outputs if c.finish_reason == "error"), None)
            if failure is not None:  # one sequence failed: the request fails, its other sequences end
                self.abort()
                raise RequestFailedError(str(failure))
            self.finished = item.finished
            if self.kind == RequestOutputKind.DELTA:
                return item
            self._acc = item if self._acc is None else merge_delta(self._acc, item)
            if self.kind == RequestOutputKind.CUMULATIVE or self.finished:
                return self._acc
        raise StopAsyncIteration

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id)


def merge_delta(acc: RequestOutput, delta: RequestOutput) -> RequestOutput:
    by_index = {c.index: c for c in acc.outputs}
    for d in delta.outputs:
        old = by_index.get(d.index)
        if old is None:
            by_index[d.index] = d
            continue
        logprobs = None if old.logprobs is None else old.logprobs + (d.logprobs or [])
        by_index[d.index] = CompletionOutput(d.index, old.text + d.text, old.token_ids + d.token_ids,
                                             d.cumulative_logprob, logprobs, d.finish_reason, d.stop_reason)
    return replace(delta, outputs=[by_index[i] for i in sorted(by_index)],
                   prompt_logprobs=delta.prompt_logprobs or acc.prompt_logprobs,
                   num_cached_tokens=max(acc.num_cached_tokens, delta.num_cached_tokens))


class AsyncLLM:
    def __init__(self, config: EngineConfig, client: EngineCoreClient, tokenizer: Any,
                 max_queue_len: int | None = None) -> None:
        self.config = config
        self.client = client
        self.tokenizer = tokenizer
        self.input_processor = InputProcessor(config.model, tokenizer, config.structured_outputs.backend)
        self.output_processor = OutputProcessor(tokenizer)
        self.metrics = EngineMetrics(config.model.served_model_name)
        self.stats = SchedulerStats()
        self.max_queue_len = max_queue_len
        self.num_blocks = 0
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._num_seqs: dict[str, int] = {}
        self._ids = itertools.count()
        self._output_task: asyncio.Task[None] | None = None
        self._error: EngineDeadError | None = None
        self.died = asyncio.Event()  # set when the core died or the output loop failed, never by shutdown
        client.on_death(self._die)

    @classmethod
    async def from_engine_args(cls, args: EngineArgs, max_queue_len: int | None = None,
                               log_level: str = "WARNING",
                               client_factory: Callable[[EngineArgs, str], EngineCoreClient] = CoreClient,
                               ) -> AsyncLLM:
        """Starts the core process (or the processes `client_factory` starts), then validates the config
        and loads the tokenizer here while the core loads the model."""
        if max_queue_len is not None and max_queue_len < 0:
            raise ValueError(f"max_queue_len must be >= 0, got {max_queue_len}")
        start = time.perf_counter()
        client = client_factory(args, log_level)  # first: the core's imports and model load overlap ours
        try:
            config = await asyncio.to_thread(args.create_engine_config)
            tokenizer = await asyncio.to_thread(load_tokenizer, config.model.tokenizer)
            front_seconds = time.perf_counter() - start
            ready = await client.wait_ready()
        except BaseException:
            client.shutdown()
            raise
        engine = cls(config, client, tokenizer, max_queue_len)
        engine.num_blocks = ready.num_blocks
        engine._output_task = asyncio.get_running_loop().create_task(engine._output_loop())
        logger.info("engine ready in %.2fs (config + tokenizer here: %.2fs; core pid %s: %d KV blocks, "
                    "engine built in %.2fs after its imports)", time.perf_counter() - start, front_seconds,
                    ready.pid, ready.num_blocks, ready.load_seconds)
        return engine

    # ---- health ----------------------------------------------------------------------------
    @property
    def is_healthy(self) -> bool:
        return self._error is None and self.client.dead is None

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self._error or self.client.dead

    @property
    def health_error(self) -> EngineDeadError | None:
        """Why /health fails: the engine's death, or a data-parallel replica lost while the others serve."""
        return self.dead_error or self.client.lost

    # ---- requests --------------------------------------------------------------------------
    def add_request(self, prompt: PromptType, params: SamplingParams, request_id: str | None = None,
                    priority: int = 0, priority_class: int = PriorityClass.INTERACTIVE,
                    group: str = "", kv: KVSharing | None = None) -> RequestStream:
        """Validates and submits at once (ValueError, QueueFullError, EngineDeadError); whatever the
        failure, the request leaves nothing behind. `priority_class` and `group` (a batch's id) are the
        scheduler's (core/scheduler.py)."""
        error = self.dead_error
        if error is not None:
            raise error
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        check_wire_values(params, priority)
        processed = self.input_processor.tokenize(prompt)
        now = time.time()
        delta_params = params.clone(output_kind=RequestOutputKind.DELTA)
        children = child_requests(request_id, delta_params)
        requests = [self.input_processor.make_request(cid, processed, cp, priority, now, priority_class, group, kv)
                    for cid, cp in children]
        interactive = priority_class == PriorityClass.INTERACTIVE
        if interactive:  # batch lines are bounded by their runner and never take the interactive queue's room
            self._check_capacity(params.n)  # after validation: a bad request is a ValueError, never a full queue
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        try:
            self.output_processor.add_request(request_id, processed.prompt, processed.prompt_token_ids,
                                              delta_params, [cid for cid, _ in children], now)
            self._queues[request_id] = queue
            if interactive:
                self._num_seqs[request_id] = params.n
            self.client.add_requests(requests)
        except BaseException:
            self.output_processor.abort(request_id)
            self._forget(request_id)
            raise
        self.metrics.request_added(request_id, now, len(processed.prompt_token_ids))
        return RequestStream(self, request_id, params.output_kind, queue)

    def _check_capacity(self, n: int) -> None:
        if self.max_queue_len is None:
            return
        capacity = self.config.scheduler.max_num_seqs * self.config.parallel.data_parallel_size + self.max_queue_len
        if n > capacity:
            raise ValueError(f"n ({n}) is more than this server's capacity of {capacity} sequences")
        if sum(self._num_seqs.values()) + n > capacity:
            raise QueueFullError(f"the server is at capacity ({capacity} sequences running or queued); retry later")

    async def generate(self, prompt: PromptType, params: SamplingParams, request_id: str | None = None,
                       priority: int = 0, kv: KVSharing | None = None) -> AsyncGenerator[RequestOutput, None]:
        stream = self.add_request(prompt, params, request_id, priority, kv=kv)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        """Stops a request (client gone, timeout); its KV blocks are freed in the core at once."""
        if request_id not in self._queues:
            return
        self.client.abort_requests(self.output_processor.child_ids(request_id))
        self.output_processor.abort(request_id)
        self.metrics.request_finished(request_id, "abort", time.time())
        self._forget(request_id)

    def release_kv(self, request_ids: list[str]) -> None:
        """Release the blocks that finished requests added with KVSharing(hold=True) keep."""
        self.client.abort_requests(request_ids)

    async def reset_prefix_cache(self) -> bool:
        return bool(await self.client.call_utility("reset_prefix_cache"))

    async def prepare_structured_output(self) -> None:
        await self.client.call_utility("prepare_structured_output")

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._queues)

    # ---- the output loop -------------------------------------------------------------------
    async def _output_loop(self) -> None:
        try:
            while True:
                self._handle_step(await self.client.get_output())
                await asyncio.sleep(0)  # a ready zmq future does not yield; let HTTP handlers run
        except EngineDeadError as e:
            self._die(e)
        except Exception as e:  # a bug here must not leave requests hanging
            logger.exception("the output loop failed")
            self._die(EngineDeadError(f"the engine front end failed: {type(e).__name__}: {e}"))

    def _handle_step(self, outs: EngineCoreOutputs) -> None:
        now = time.time()
        if outs.stats is not None:
            self.stats = outs.stats
            self.metrics.scheduler_stats(outs.stats)
        for request_id, when in self.output_processor.record_scheduled(outs.scheduled):
            self.metrics.request_scheduled(request_id, when)
        results, to_stop = self.output_processor.process(outs.outputs)
        if to_stop:
            self.client.abort_requests(to_stop)
        for out in results:
            self.metrics.output(out, now)
            queue = self._queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)
            if out.finished:
                self._forget(out.request_id)

    def _forget(self, request_id: str) -> None:
        self._queues.pop(request_id, None)
        self._num_seqs.pop(request_id, None)

    def end_all(self, error: EngineDeadError) -> None:
        """Ends every request in flight with `error` and refuses new ones (a server's drain deadline);
        the core, if alive, frees their KV blocks."""
        if self.client.dead is None:
            ids = [cid for rid in self._queues for cid in self.output_processor.child_ids(rid)]
            try:
                self.client.abort_requests(ids)
            except EngineDeadError:
                pass  # dead meanwhile: nothing to free
        self._fail_all(error)

    def _die(self, error: EngineDeadError) -> None:
        self._fail_all(error)
        self.died.set()

    def _fail_all(self, error: EngineDeadError) -> None:
        if self._error is None:
            self._error = error
        now = time.time()
        for rid, queue in list(self._queues.items()):
            queue.put_nowait(error)
            self.output_processor.abort(rid)
            self.metrics.request_finished(rid, "error", now)
        self._queues.clear()
        self._num_seqs.clear()
        task = self._output_task
        if task is not None and not task.done() and task is not asyncio.current_task():
            task.cancel()

    async def shutdown(self) -> None:
        self._fail_all(ServerShutdownError("the server is shutting down"))
        try:
            if self._output_task is not None and not self._output_task.done():
                await asyncio.wait([self._output_task], timeout=1.0)
        finally:
            self.client.shutdown()


def check_wire_values(params: SamplingParams, priority: int) -> None:
    """What the engine core's wire cannot carry: integers beyond signed 64 bits and text that is not
    valid Unicode (a lone surrogate, which JSON's \\ud800 escapes can produce)."""
    if not -_INT64 <= priority < _INT64:
        raise ValueError(f"priority must fit in a signed 64-bit integer, got {priority}")
    for s in params.stop:
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"stop has a string that is not valid Unicode (a lone surrogate): {s!r}") from None
