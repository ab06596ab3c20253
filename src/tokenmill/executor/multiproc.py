"""A process per rank on this machine (vLLM's `--distributed-executor-backend mp`).

Each rank's Worker runs in a process started with spawn, fed by a pipe. A call (a Worker method by
name, the step's SchedulerOutput included) is pickled once and the same bytes are written to every
rank's pipe: pipes rather than a shared-memory ring, since there are a few ranks, a step's message is
kilobytes, and the OS does the blocking, the waking and the report of a closed end for us. Every rank
answers the calls that collect every rank's result (`collective_rpc`); on steps only the output rank
answers (rank 0, or under pipeline parallelism the last stage's first rank, which samples) and the
others stay silent.

One sender thread writes the calls in the order they are made: a step whose token bitmasks are still
being filled (structured output's Future, which the xgrammar thread fills once the tokens of the step
in flight are told, on the engine's thread after that step's output) waits for them there, not on the
engine's thread. One reader thread takes the answers in the order the calls were sent and resolves
each call's Future, and waits on every worker's process sentinel beside them: a worker that exits
(killed, crashed, or failed a step, after which its group's collectives are out of step) fails every
call in flight and every later one with WorkerDied, and the other workers are stopped, so nothing
waits on a dead rank.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import logging
import multiprocessing
import pickle
import queue
import signal
import tempfile
import threading
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from multiprocessing import connection
from multiprocessing.process import BaseProcess
from typing import Any

from tokenmill.config import EngineConfig
from tokenmill.core.sched_output import ModelRunnerOutput, SchedulerOutput
from tokenmill.executor.abstract import Executor, WorkerDied
from tokenmill.fast_exit import fast_exit

logger = logging.getLogger(__name__)
_STEP_METHODS = ("execute_model",)  # a rank that fails one leaves its group out of step: it exits
_SHUTDOWN = "shutdown"
_JOIN_S = 5.0  # how long a worker gets to exit by itself at shutdown


@dataclass
class _Call:
    method: str
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    reply_ranks: int = 1  # how many ranks answer: those from first_reply_rank on
    first_reply_rank: int = 0

    def answered_by(self, rank: int) -> bool:
        return self.first_reply_rank <= rank < self.first_reply_rank + self.reply_ranks


@dataclass
class _Reply:
    result: Any = None
    error: str | None = None
    value_error: bool = False  # a configuration the user can change: raised as ValueError
    fatal: bool = False  # the worker exits after sending this


class RankCallExecutor(Executor):
    """An executor whose ranks each get every call (`_post`: a Future for each answering rank's answer) and
    that fails every call once a rank is dead (`_dead`): the multiprocess and the Ray executors. The
    ranks run the steps in the order they were sent, so the next one is scheduled while this one computes;
    the output rank (rank 0, or the last pipeline stage's first) answers a step."""

    world_size: int
    _dead: WorkerDied | None

    def _post(self, call: _Call) -> list[Future[Any]]:
        raise NotImplementedError

    def collective_rpc(self, method: str, args: tuple[Any, ...] = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        futures = self._post(_Call(method, args, kwargs or {}, self.world_size))
        return [f.result() for f in futures]

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.submit(so).result()

    def submit(self, so: SchedulerOutput) -> Future[ModelRunnerOutput]:
        call = _Call("execute_model", (so,), first_reply_rank=self.config.parallel.output_rank)
        future: Future[ModelRunnerOutput] = self._post(call)[0]
        return future

    def check_health(self) -> None:
        if self._dead is not None:
            raise self._dead


class MultiprocExecutor(RankCallExecutor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.world_size = config.parallel.world_size
        self._tmp = tempfile.TemporaryDirectory(prefix="tokenmill-workers-")
        self._procs: list[BaseProcess] = []
        self._calls: list[connection.Connection] = []  # ours to write, one per rank
        self._replies: list[connection.Connection] = []  # ours to read
        self._pending: list[deque[Future[Any]]] = [deque() for _ in range(self.world_size)]
        self._lock = threading.Lock()
        self._dead: WorkerDied | None = None
        self._cause: str | None = None  # the first error a worker reported before exiting
        self._closing = False
        self._outbox: queue.SimpleQueue[tuple[_Call, list[Future[Any]]] | None] = queue.SimpleQueue()
        ready = self._expect(range(self.world_size))  # each worker answers once its model is loaded
        try:
            self._start_workers()
        except BaseException:
            self.shutdown()
            raise
        self._reader = threading.Thread(target=self._read_replies, name="tokenmill-worker-replies", daemon=True)
        self._reader.start()
        self._sender = threading.Thread(target=self._send_calls, name="tokenmill-worker-calls", daemon=True)
        self._sender.start()
        # an engine never shut down stops its workers at exit before multiprocessing terminates them (which
        # would read as deaths)
        atexit.register(self.shutdown)
        wait(ready)
        errors = [e for f in ready if (e := f.exception()) is not None]
        if errors:
            self.shutdown()
            raise next((e for e in errors if isinstance(e, ValueError)), errors[0])

    @property
    def pids(self) -> list[int | None]:
        return [p.pid for p in self._procs]

    def _start_workers(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        init_file = f"{self._tmp.name}/rendezvous"
        level = logging.getLogger().getEffectiveLevel()
        with _children_allowed():
            for rank in range(self.world_size):
                calls_in, calls_out = ctx.Pipe(duplex=False)
                replies_in, replies_out = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=_worker_main, name=f"tokenmill-worker-{rank}", daemon=True,
                                   args=(self.config, rank, init_file, calls_in, replies_out, level))
                proc.start()
                calls_in.close()
                replies_out.close()
                self._procs.append(proc)
                self._calls.append(calls_out)
                self._replies.append(replies_in)

    # ---- the Executor interface --------------------------------------------------------------------

    def shutdown(self) -> None:
        if self._closing:
            return
        self._closing = True
        atexit.unregister(self.shutdown)
        self._outbox.put(None)
        if hasattr(self, "_sender"):
            self._sender.join(_JOIN_S)
        with contextlib.suppress(OSError, ValueError):
            data = pickle.dumps(_Call(_SHUTDOWN, reply_ranks=0))
            for conn in self._calls:
                conn.send_bytes(data)
        for proc in self._procs:
            proc.join(_JOIN_S)
            if proc.is_alive():
                proc.kill()
                proc.join(1.0)
        for conn in self._calls + self._replies:
            conn.close()
        with self._lock:  # every later call fails at once
            self._dead = self._dead or WorkerDied("the executor has shut down")
        self._fail_pending(self._dead)
        self._tmp.cleanup()

    # ---- calls and answers -------------------------------------------------------------------------

    def _expect(self, ranks: range) -> list[Future[Any]]:
        """One Future for the next answer of each of these ranks."""
        futures: list[Future[Any]] = [Future() for _ in ranks]
        with self._lock:
            if self._dead is not None:
                raise self._dead
            for rank, f in zip(ranks, futures, strict=True):
                self._pending[rank].append(f)
        return futures

    def _post(self, call: _Call) -> list[Future[Any]]:
        """Queue a call for the sender thread; a Future for each answering rank's answer."""
        if self._dead is not None:
            raise self._dead
        outers: list[Future[Any]] = [Future() for _ in range(call.reply_ranks)]
        self._outbox.put((call, outers))
        return outers

    def _send_calls(self) -> None:
        while (item := self._outbox.get()) is not None:
            call, outers = item
            try:
                inners = self._send(_with_bitmasks(call))
            except BaseException as e:  # (a dead executor; a bitmask that failed)
                for outer in outers:
                    outer.set_exception(e)
                continue
            for inner, outer in zip(inners, outers, strict=True):
                inner.add_done_callback(functools.partial(_copy_outcome, outer))

    def _send(self, call: _Call) -> list[Future[Any]]:
        data = pickle.dumps(call, protocol=pickle.HIGHEST_PROTOCOL)  # once, whatever the ranks
        futures = self._expect(range(call.first_reply_rank, call.first_reply_rank + call.reply_ranks))
        try:
            for conn in self._calls:
                conn.send_bytes(data)
        except OSError:  # a worker is gone: the reader thread fails these futures with why
            pass
        return futures

    def _read_replies(self) -> None:
        try:
            self._read_until_a_worker_ends()
        except Exception as e:  # (a bug here must not leave the engine waiting on its Futures)
            logger.exception("the executor's reader thread failed")
            with self._lock:
                self._dead = WorkerDied(f"the executor's reader thread failed: {type(e).__name__}: {e}")
            self._fail_pending(self._dead)

    def _read_until_a_worker_ends(self) -> None:
        by_reply = {conn: rank for rank, conn in enumerate(self._replies)}
        by_sentinel = {proc.sentinel: rank for rank, proc in enumerate(self._procs)}
        waiting: list[Any] = [*by_reply, *by_sentinel]
        while not self._closing:
            for ready in connection.wait(waiting, timeout=1.0):
                if self._closing:
                    return
                rank = by_reply.get(ready)  # type: ignore[call-overload]
                if rank is None:  # a process ended: its last answers first
                    rank = by_sentinel[ready]  # type: ignore[index]
                    while self._read_one(rank, self._replies[rank]):
                        pass
                    self._worker_died(rank)
                    return
                if not self._read_one(rank, ready):  # type: ignore[arg-type]
                    self._worker_died(rank)
                    return

    def _read_one(self, rank: int, conn: connection.Connection) -> bool:
        """Take one answer from `rank` if one is there; False at the end of its pipe."""
        try:
            if not conn.poll():
                return False
            reply: _Reply = conn.recv()
        except (EOFError, OSError):
            return False
        if reply.fatal and self._cause is None:
            self._cause = f"rank {rank}: {reply.error}"
        with self._lock:
            future = self._pending[rank].popleft() if self._pending[rank] else None
        if future is None:  # a silent rank's report of the step it failed
            return True
        if (error := reply_error(rank, reply)) is None:
            future.set_result(reply.result)
        else:
            future.set_exception(error)
        return True

    def _worker_died(self, rank: int) -> None:
        if self._closing:  # (workers end at shutdown)
            return
        proc = self._procs[rank]
        proc.join(1.0)
        code = proc.exitcode
        how = (f"killed by {signal.Signals(-code).name}" if code is not None and code < 0
               else f"exit code {code}")
        message = f"worker rank {rank} (pid {proc.pid}) died ({how})"
        if self._cause is not None:
            message += f" after an error in {self._cause}"
        error = WorkerDied(message)
        with self._lock:
            self._dead = error
        logger.error("%s; stopping the other workers", message)
        for other in self._procs:  # they cannot go on without it (their collectives would wait)
            if other.is_alive():
                other.kill()
        self._fail_pending(error)

    def _fail_pending(self, error: Exception) -> None:
        with self._lock:
            pending = [f for q in self._pending for f in q]
            for q in self._pending:
                q.clear()
        for f in pending:
            if not f.done():
                f.set_exception(error)


def reply_error(rank: int, reply: _Reply) -> Exception | None:
    """The error a rank's reply stands for, as the caller sees it; None for a result."""
    if reply.error is None:
        return None
    if reply.value_error:
        return ValueError(reply.error)
    return (WorkerDied if reply.fatal else RuntimeError)(f"worker rank {rank}: {reply.error}")


def _with_bitmasks(call: _Call) -> _Call:
    """A step whose token bitmasks are a Future, with them filled in (the workers take the arrays)."""
    so = call.args[0] if call.method == "execute_model" else None
    if isinstance(so, SchedulerOutput) and isinstance(so.grammar_bitmask, Future):
        so = dataclasses.replace(so, grammar_bitmask=so.grammar_bitmask.result())
        return dataclasses.replace(call, args=(so,))
    return call


def _copy_outcome(outer: Future[Any], inner: Future[Any]) -> None:
    if (error := inner.exception()) is not None:
        outer.set_exception(error)
    else:
        outer.set_result(inner.result())


@contextlib.contextmanager
def _children_allowed() -> Iterator[None]:
    """The engine core process is daemonic (engine/core_client.py) and multiprocessing refuses a daemonic
    process children; its workers end with it anyway (each exits when its call pipe closes), so the
    flag is lifted while they start."""
    config = multiprocessing.current_process()._config  # type: ignore[attr-defined]
    daemon = config.pop("daemon", None)
    try:
        yield
    finally:
        if daemon is not None:
            config["daemon"] = daemon


def _worker_main(config: EngineConfig, rank: int, init_file: str, calls: connection.Connection,
                 replies: connection.Connection, log_level: int) -> None:
    """A worker process: load the rank's model, answer READY (an empty reply), then run calls until
    told to stop or its pipe closes (the executor's process is gone)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine's process owns Ctrl-C
    logging.basicConfig(level=log_level, format=f"%(levelname)s %(name)s [rank {rank}]: %(message)s")
    try:
        from tokenmill.worker.worker import Worker

        worker = Worker(config, rank, init_file)
    except Exception as e:
        replies.send(_Reply(error=_describe(e), value_error=isinstance(e, ValueError), fatal=True))
        fast_exit(1)
    replies.send(_Reply())
    fast_exit(_serve(worker, rank, calls, replies))


def _serve(worker: Any, rank: int, calls: connection.Connection, replies: connection.Connection) -> int:
    while True:
        try:
            call: _Call = pickle.loads(calls.recv_bytes())
        except (EOFError, OSError):
            return 0
        if call.method == _SHUTDOWN:
            return 0
        reply = run_call(worker, rank, call)
        if reply.fatal or call.answered_by(rank):
            replies.send(reply)
        if reply.fatal:
            return 1


def run_call(worker: Any, rank: int, call: _Call) -> _Reply:
    """One call on this rank's worker (every executor's ranks run calls so): its result, or its error
    as the executor reports it, `fatal` where a failed step leaves the group out of step."""
    try:
        return _Reply(getattr(worker, call.method)(*call.args, **call.kwargs))
    except Exception as e:
        logger.exception("worker rank %d: %s failed", rank, call.method)
        return _Reply(error=_describe(e), value_error=isinstance(e, ValueError), fatal=call.method in _STEP_METHODS)


def _describe(e: BaseException) -> str:
    return str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
