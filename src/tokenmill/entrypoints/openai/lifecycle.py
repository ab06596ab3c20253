"""How a running server ends, and with which exit status.

A stop signal (SIGTERM, Ctrl-C) drains: every new request gets 503, those in flight run on for up to
--shutdown-timeout seconds, then the rest end with an error (a 503 error object, or an SSE error
event and [DONE]) and the web server closes; a second signal ends them at once. A dead engine core
ends every request with an error the same way, and the process exits non-zero, so a supervisor
restarts it (what vLLM does).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from prometheus_client import Gauge
from starlette.types import ASGIApp, Receive, Scope, Send

from tokenmill.engine.async_engine import AsyncLLM, ServerShutdownError
from tokenmill.entrypoints.openai.errors import APIError

logger = logging.getLogger(__name__)

# `tokenmill serve --help` documents these (cli_serve.EXIT_STATUS_HELP)
EXIT_OK = 0  # stopped by a signal with every request finished
EXIT_ENGINE_DEAD = 1  # the engine core died (or its front end failed)
EXIT_REQUESTS_CUT = 3  # stopped by a signal; --shutdown-timeout (or a second signal) ended requests
# seconds the error responses get to reach their clients once their requests were ended
CLOSE_GRACE = 5.0


class ServerLifecycle:
    """Counts the HTTP requests in flight (through `wrap`; shown in /metrics), refuses new ones once
    the server is stopping, and decides when the web server closes (`stop_server`) and with which
    exit status."""

    def __init__(self, engine: AsyncLLM, shutdown_timeout: float) -> None:
        self.engine = engine
        self.shutdown_timeout = shutdown_timeout
        self.exit_code = EXIT_OK
        self.refusal: str | None = None  # why new requests get 503, once the server is stopping
        self.in_flight = 0
        metrics = engine.metrics
        Gauge("tokenmill:http_requests_in_flight", "HTTP requests being answered (/metrics scrapes not counted).",
              ["model_name"], registry=metrics.registry).labels(metrics.model_name).set_function(
                  lambda: self.in_flight)
        self._idle = asyncio.Event()
        self._idle.set()
        self._force = asyncio.Event()
        self._stop_server: Callable[[], None] = lambda: None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def wrap(self, app: ASGIApp) -> ASGIApp:
        return _Guard(app, self)

    def start(self, stop_server: Callable[[], None]) -> None:
        """Watches the engine from now on; stop_server tells the web server to close."""
        self._stop_server = stop_server
        self._loop = asyncio.get_running_loop()
        self._spawn(self._watch_engine())

    def signal_received(self) -> None:
        """From a signal handler: the first signal starts the drain, a second ends it at once."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._on_signal)

    def _on_signal(self) -> None:
        if self.refusal is None:
            self._spawn(self._drain())
        else:
            self._force.set()

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _drain(self) -> None:
        self.refusal = "the server is shutting down"
        logger.warning("stopping: %d requests in flight may run for up to %gs (a second signal ends them now); "
                       "new requests get 503", self.in_flight, self.shutdown_timeout)
        if not await self._wait_idle(self.shutdown_timeout, self._force):
            logger.warning("ending %d requests still in flight", self.engine.num_unfinished_requests)
            if self.exit_code == EXIT_OK:
                self.exit_code = EXIT_REQUESTS_CUT
            why = ("a second stop signal" if self._force.is_set()
                   else f"--shutdown-timeout {self.shutdown_timeout:g}s")
            self.engine.end_all(ServerShutdownError(f"the server shut down before the request finished ({why})"))
            await self._wait_idle(CLOSE_GRACE)
        self._stop_server()

    async def _watch_engine(self) -> None:
        await self.engine.died.wait()  # every request in flight has its error by now
        self.exit_code = EXIT_ENGINE_DEAD
        self.refusal = "the engine is not available; the server is exiting"
        self._force.set()
        await self._wait_idle(CLOSE_GRACE)
        self._stop_server()

    async def _wait_idle(self, timeout: float, interrupt: asyncio.Event | None = None) -> bool:
        """Waits until no request is in flight (True), `timeout` passes or `interrupt` is set."""
        waits = [asyncio.ensure_future(self._idle.wait())]
        if interrupt is not None:
            waits.append(asyncio.ensure_future(interrupt.wait()))
        try:
            await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        return self._idle.is_set()

    def enter(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()


class _Guard:
    """The outermost ASGI layer: counts HTTP requests in flight; refuses new ones with 503 (and
    Connection: close) once the server is stopping. /metrics is always answered and never counted,
    so a drain can be watched."""

    def __init__(self, app: ASGIApp, lifecycle: ServerLifecycle) -> None:
        self.app = app
        self.lifecycle = lifecycle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] == "/metrics":
            await self.app(scope, receive, send)
            return
        refusal = self.lifecycle.refusal
        if refusal is not None:
            await _refuse(send, refusal)
            return
        self.lifecycle.enter()
        try:
            await self.app(scope, receive, send)
        finally:
            self.lifecycle.leave()


async def _refuse(send: Send, message: str) -> None:
    error = APIError("shutting_down", message)
    body = error.body().model_dump_json().encode()
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})
