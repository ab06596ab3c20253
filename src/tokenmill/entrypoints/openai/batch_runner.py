"""Runs the server's batches: validates a batch's input file into lines, runs its pending lines through
the app in-process (batch_lines.call_app: the batch priority class, the online routes' own code), commits
each line as it finishes, and ends the batch (completed, expired at its completion window, cancelled)
by writing its output and error files. On start it resumes every batch a crash or stop left unfinished.

Every store call runs on one thread (the store is synchronous; the event loop never waits on disk)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from starlette.types import ASGIApp

from tokenmill.entrypoints.openai.batch_lines import ParsedLine, call_app, parse_line
from tokenmill.entrypoints.openai.batch_store import BatchStore, LineResult, PendingLine, read_lines

logger = logging.getLogger(__name__)
T = TypeVar("T")
RETRY_SECONDS = 0.5  # after a 429 (the server's queue is full)
EXPIRED_ERROR = {"code": "batch_expired", "message": "This line was not executed because the batch expired."}


class BatchRunner:
    def __init__(self, store: BatchStore, app: ASGIApp | None = None, lines_in_flight: int = 64) -> None:
        self.store = store
        self.app = app  # set before start(): the app whose routes run the lines
        self.lines_in_flight = lines_in_flight  # per batch; the scheduler takes turns between batches
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="tokenmill-batch-store")
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._work: dict[str, asyncio.Future[None]] = {}  # each running batch's lines
        self._cancel_requested: set[str] = set()

    async def db(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._thread, lambda: fn(*args, **kwargs))

    async def start(self) -> None:
        """Resumes the batches left unfinished."""
        for batch_id in await self.db(self.store.unfinished_batches):
            logger.info("resuming batch %s", batch_id)
            self.submit(batch_id)

    async def stop(self) -> None:
        """Stops running lines (they stay pending, for the next start); no batch changes status."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
        await asyncio.get_running_loop().run_in_executor(None, self._thread.shutdown)
        self.store.close()

    def submit(self, batch_id: str) -> None:
        task = asyncio.get_running_loop().create_task(self._supervise(batch_id))
        self._tasks[batch_id] = task
        task.add_done_callback(lambda _: self._tasks.pop(batch_id, None))

    def cancel(self, batch_id: str) -> None:
        """The batch is `cancelling` in the store: stop its lines and end it as cancelled."""
        self._cancel_requested.add(batch_id)
        work = self._work.get(batch_id)
        if work is not None:
            work.cancel()  # cancels the lines in flight: their requests are aborted in the engine
        elif batch_id not in self._tasks:
            self.submit(batch_id)  # it was not running (it ends at once)

    async def _supervise(self, batch_id: str) -> None:
        try:
            batch = await self.db(self.store.get_batch, batch_id)
            if batch is None:
                return
            if batch["status"] == "validating":
                batch = await self._validate(batch)
            if batch["status"] == "in_progress":
                batch = await self._run_until_done(batch)
            if batch["status"] == "finalizing":
                await self.db(self.store.finish_batch, batch_id, "completed", None)
            elif batch["status"] == "cancelling":
                await self.db(self.store.finish_batch, batch_id, "cancelled", None)
        except asyncio.CancelledError:
            raise
        except _ServerGoingDown:
            logger.warning("batch %s paused: the server cannot run its lines now; it resumes on restart", batch_id)
        except Exception:
            logger.exception("batch %s failed", batch_id)
            await self.db(self.store.set_status, batch_id, "failed",
                          errors=_errors("internal_error", "the batch failed inside tokenmill (see the server log)"))
        finally:
            self._cancel_requested.discard(batch_id)

    async def _validate(self, batch: dict[str, Any]) -> dict[str, Any]:
        batch_id = batch["id"]
        path = self.store.path_of(batch["input_file_id"])
        try:
            texts = await self.db(lambda: list(read_lines(path)))
        except OSError as e:
            moved = await self.db(self.store.set_status, batch_id, "failed",
                                  errors=_errors("invalid_file", f"the input file cannot be read: {e.strerror}"))
            return moved or batch
        seen: set[str] = set()
        parsed: list[ParsedLine] = [parse_line(t, batch["endpoint"], seen) for t in texts if t.strip()]
        rows = [(p.custom_id, p.body, None if p.error is None else p.error_record) for p in parsed]
        await self.db(self.store.add_lines, batch_id, rows)
        if not rows:
            moved = await self.db(self.store.set_status, batch_id, "failed",
                                  errors=_errors("empty_file", "the input file has no lines"))
        else:
            moved = await self.db(self.store.set_status, batch_id, "in_progress", only_from=("validating",))
        return moved or await self.db(self.store.get_batch, batch_id) or batch

    async def _run_until_done(self, batch: dict[str, Any]) -> dict[str, Any]:
        """Runs the pending lines until none is left, the batch expires or is cancelled; returns the
        batch in the status that says how to end it (finalizing, cancelling) or ended (expired)."""
        batch_id = batch["id"]
        remaining = float(batch["expires_at"]) - time.time()
        work = asyncio.ensure_future(self._run_lines(batch_id))
        self._work[batch_id] = work
        try:
            await asyncio.wait({work}, timeout=max(remaining, 0.0))
        finally:
            self._work.pop(batch_id, None)
            if not work.done():
                work.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await work
        current = await self.db(self.store.get_batch, batch_id)
        assert current is not None
        if current["status"] == "cancelling" or batch_id in self._cancel_requested:
            return current
        if work.cancelled() or not work.done():
            return await self.db(self.store.finish_batch, batch_id, "expired", EXPIRED_ERROR)
        work.result()  # its error, if it failed
        moved = await self.db(self.store.set_status, batch_id, "finalizing", only_from=("in_progress",))
        return moved or current

    async def _run_lines(self, batch_id: str) -> None:
        pending = await self.db(self.store.pending_lines, batch_id)
        gate = asyncio.Semaphore(self.lines_in_flight)
        going_down = asyncio.Event()

        async def run(line: PendingLine) -> None:
            async with gate:
                if going_down.is_set() or batch_id in self._cancel_requested:
                    return
                result = await self._answer(batch_id, line)
                if result is None:
                    going_down.set()
                    return
                await self.db(self.store.finish_line, batch_id, result)

        tasks = [asyncio.ensure_future(run(line)) for line in pending]
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
        if batch_id in self._cancel_requested:
            raise asyncio.CancelledError
        if going_down.is_set():
            raise _ServerGoingDown

    async def _answer(self, batch_id: str, line: PendingLine) -> LineResult | None:
        """The line's answer; None when the server cannot give one now (engine gone, shutting down)."""
        assert self.app is not None
        while True:
            answer = await call_app(self.app, line.body, batch_id)
            if answer.status == 429:
                await asyncio.sleep(RETRY_SECONDS)
                continue
            if answer.retry:
                return None
            return LineResult(line.line_no, answer.record(line.custom_id), 200 <= answer.status < 300)


class _ServerGoingDown(Exception):
    pass


def _errors(code: str, message: str) -> dict[str, Any]:
    return {"object": "list", "data": [{"code": code, "message": message, "param": None, "line": None}]}
