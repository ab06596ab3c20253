"""The API process's side of the engine core: spawns the core process (core_proc), owns the
two ZMQ sockets (messages in wire), and notices the core's death through its process sentinel."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any, Protocol

import msgspec
import zmq
import zmq.asyncio

from tokenmill.config import EngineArgs
from tokenmill.core.messages import EngineCoreOutputs, EngineCoreRequest
from tokenmill.engine.core_proc import run_engine_core
from tokenmill.engine.wire import (
    ABORT,
    ADD,
    FAILED,
    OUTPUTS,
    READY,
    SHUTDOWN,
    UTILITY,
    UTILITY_RESULT,
    AbortRequests,
    CoreReady,
    EngineDeadError,
    UtilityCall,
    decode,
    encode,
)

logger = logging.getLogger(__name__)


class EngineCoreClient(Protocol):
    """What AsyncLLM needs of its engine core: a CoreClient (one core process), or a client over several
    replicas of it (`--data-parallel-size`, entrypoints/router/data_parallel.py)."""

    dead: EngineDeadError | None  # no core serves any more
    lost: EngineDeadError | None  # a replica is gone while others serve (/health reports it)

    @property
    def pid(self) -> int | None: ...

    async def wait_ready(self) -> CoreReady: ...

    def on_death(self, callback: Callable[[EngineDeadError], None]) -> None: ...

    def add_requests(self, requests: list[EngineCoreRequest]) -> None: ...

    def abort_requests(self, request_ids: list[str]) -> None: ...

    async def call_utility(self, method: str) -> Any: ...

    async def get_output(self) -> EngineCoreOutputs: ...

    def shutdown(self, timeout: float = 5.0) -> None: ...


class CoreClient:
    """Owns the core process and both sockets. Use from one asyncio event loop."""

    lost: EngineDeadError | None = None  # (one core: its loss is `dead`)

    def __init__(self, args: EngineArgs, log_level: str = "WARNING") -> None:
        self.tmpdir = tempfile.mkdtemp(prefix="tokenmill-")
        input_addr = f"ipc://{os.path.join(self.tmpdir, 'input')}"
        output_addr = f"ipc://{os.path.join(self.tmpdir, 'output')}"
        # sends never wait: no high-water mark, and NOBLOCK, because a PUSH socket whose peer is gone
        # (a core that just died, or got the SIGTERM a whole process group gets) blocks a send
        # forever, event loop and all; so the input side is a plain socket, and only receiving is awaited
        self.sync_ctx = zmq.Context()
        self.input = self.sync_ctx.socket(zmq.PUSH)
        self.input.setsockopt(zmq.SNDHWM, 0)
        self.input.setsockopt(zmq.LINGER, 0)
        self.input.bind(input_addr)
        self.ctx = zmq.asyncio.Context()
        self.output = self.ctx.socket(zmq.PULL)
        self.output.setsockopt(zmq.RCVHWM, 0)
        self.output.setsockopt(zmq.LINGER, 0)
        self.output.bind(output_addr)
        mp = multiprocessing.get_context("spawn")
        self.proc = mp.Process(target=run_engine_core, args=(args, input_addr, output_addr, log_level),
                               name="tokenmill-core", daemon=True)
        self.proc.start()
        self.ready = False
        self.dead: EngineDeadError | None = None
        self._death_callbacks: list[Callable[[EngineDeadError], None]] = []
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._call_ids = 0

    @property
    def pid(self) -> int | None:
        return self.proc.pid

    async def wait_ready(self) -> CoreReady:
        """Waits for the core to load; a failure or a death during startup raises ValueError."""
        while True:
            if await self.output.poll(200):
                kind, msg = decode(await self.output.recv_multipart())
                if kind == READY:
                    self.ready = True
                    asyncio.get_running_loop().add_reader(self.proc.sentinel, self._on_exit)
                    return msg
                if kind == FAILED:
                    raise ValueError(f"the engine core failed to start: {msg.message}")
            elif not self.proc.is_alive():
                raise ValueError(f"the engine core process exited during startup (exit code "
                                 f"{self.proc.exitcode}); see the log above")

    def on_death(self, callback: Callable[[EngineDeadError], None]) -> None:
        self._death_callbacks.append(callback)

    def _on_exit(self) -> None:
        asyncio.get_running_loop().remove_reader(self.proc.sentinel)
        self.proc.join(1)
        self._mark_dead(EngineDeadError(f"the engine core process died (exit code {self.proc.exitcode})"))

    def _mark_dead(self, error: EngineDeadError) -> None:
        if self.dead is not None:
            return
        logger.error("%s", error)
        self.dead = error
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(error)
        for cb in self._death_callbacks:
            cb(error)

    def _send(self, kind: bytes, msg: msgspec.Struct | list[EngineCoreRequest]) -> None:
        self._send_bytes(kind, encode(msg))

    def _send_bytes(self, kind: bytes, payload: bytes) -> None:
        if self.dead is not None:
            raise self.dead
        try:
            self.input.send_multipart([kind, payload], zmq.NOBLOCK)
        except zmq.Again:  # no core on the other end: it died before its sentinel was seen
            raise EngineDeadError("the engine core is not reachable") from None

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        """One message, so the n children of a request reach the same step. A request the wire cannot
        carry (an integer past 64 bits, a lone surrogate in a string) is a ValueError, and nothing is sent."""
        try:
            payload = encode(requests)
        except (msgspec.EncodeError, OverflowError, UnicodeEncodeError, TypeError) as e:
            raise ValueError(f"the request cannot be sent to the engine core: {e}") from None
        self._send_bytes(ADD, payload)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and self.dead is None:
            self._send(ABORT, AbortRequests(request_ids))

    async def call_utility(self, method: str) -> Any:
        self._call_ids += 1
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[self._call_ids] = fut
        self._send(UTILITY, UtilityCall(self._call_ids, method))
        return await fut

    async def get_output(self) -> EngineCoreOutputs:
        """The next batch of outputs; utility results are resolved on the way."""
        while True:
            if self.dead is not None:
                raise self.dead
            kind, msg = decode(await self.output.recv_multipart())
            if kind == OUTPUTS:
                return msg
            if kind == UTILITY_RESULT:
                fut = self._pending.pop(msg.call_id, None)
                if fut is not None and not fut.done():
                    if msg.error:
                        fut.set_exception(RuntimeError(msg.error))
                    else:
                        fut.set_result(msg.result)
            elif kind == FAILED:
                self._mark_dead(EngineDeadError(f"the engine core failed: {msg.message}"))

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stops the core (SHUTDOWN; SIGTERM, which stops a core still loading; then SIGKILL) and releases
        the sockets."""
        self.dead = self.dead or EngineDeadError("the engine has shut down")
        try:
            if self.proc.is_alive() and self.ready:  # a core still loading cannot read; stop it at once
                with contextlib.suppress(zmq.Again):  # no peer: the core is exiting already
                    self.input.send_multipart([SHUTDOWN, b""], zmq.NOBLOCK)
                    self.proc.join(timeout)
            if self.proc.is_alive():
                self.proc.terminate()
                self.proc.join(2)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(2)
        finally:
            try:
                asyncio.get_running_loop().remove_reader(self.proc.sentinel)
            except (RuntimeError, ValueError, OSError):
                pass
            self.input.close(0)
            self.output.close(0)
            self.ctx.term()
            self.sync_ctx.term()
            shutil.rmtree(self.tmpdir, ignore_errors=True)
