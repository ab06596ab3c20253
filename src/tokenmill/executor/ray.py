"""A Ray actor per rank (vLLM's `--distributed-executor-backend ray`), so the ranks can span the
machines of a Ray cluster.

Which cluster: as `ray.init()` decides, as vLLM leaves it: RAY_ADDRESS where it is set (its port is
tried first, so an address nothing answers at is one clear error at start, not Ray's minutes of
retries), else a cluster started on this machine by `ray start`, else a local Ray started for this
engine and shut down with it. A process already connected to Ray (`ray.init` called before the
engine) keeps its connection.

The ranks are placed in one placement group, a bundle per rank of the CPUs its compute threads take
(PACK: on one node where they fit, across nodes where they do not); a cluster with fewer CPUs in all,
or whose CPUs stay taken for PLACEMENT_TIMEOUT_S, is refused at start. Rank 0's actor names a free
port on its node, and the ranks join their gloo group at that tcp:// address (a file would not reach
other machines).

Each call is pickled once and the same bytes go to every rank's actor as a Ray remote call; the actors
run their calls one at a time, in the order sent (a single-threaded actor runs one submitter's calls
so; a sequence number checks it), on the worker code the multiprocess executor's ranks run
(multiproc.run_call). Rank 0 answers every call, the others only the calls that collect every rank's
result; as in multiproc.py, one sender thread sends them in order (a step's structured-output
bitmasks are waited for there). Each actor also holds one call in a second concurrency group that
returns only when the actor ends: an actor that dies (killed, crashed, its node lost), whether a step
is running or not, fails that call, and with it every call in flight and every later one with
WorkerDied; a rank that fails a step (its group is then out of step) does the same, and the other
actors are killed, so nothing waits on a dead rank.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import pickle
import queue
import socket
import threading
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from tokenmill.config import EngineConfig, default_num_threads
from tokenmill.executor.abstract import WorkerDied
from tokenmill.executor.multiproc import (
    RankCallExecutor,
    _Call,
    _describe,
    _Reply,
    _with_bitmasks,
    reply_error,
    run_call,
)

logger = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 60.0  # how long the ranks' placement group may wait for free CPUs
_CONNECT_TIMEOUT_S = 5.0  # how long RAY_ADDRESS's port gets to answer
_PEER_DEATH_GRACE_S = 3.0  # how long a rank's failed step waits for a peer's death to explain it
_WATCH_GROUP = "watch"  # the actors' concurrency group of the call that ends only with the actor


class _RankActor:
    """One rank's Worker inside a Ray actor (made remote in RayExecutor)."""

    def __init__(self, rank: int, log_level: int) -> None:
        logging.basicConfig(level=log_level, format=f"%(levelname)s %(name)s [rank {rank}]: %(message)s")
        self.rank = rank
        self.worker: Any = None
        self.next_seq = 0

    def where(self) -> tuple[str, int]:
        """(this actor's node address, as the Ray cluster knows it; its pid)."""
        node_id = ray.get_runtime_context().get_node_id()
        host = next((n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id), None)
        return host or ray.util.get_node_ip_address(), os.getpid()

    def rendezvous_address(self) -> str:
        """A tcp:// address on this node for the group's rendezvous (rank 0's)."""
        host = self.where()[0]
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        return f"tcp://{host}:{port}"

    def start(self, config: EngineConfig, rendezvous: str) -> _Reply:
        """Load this rank's model (joining the group); an error is the reply, not an exception."""
        try:
            from tokenmill.worker.worker import Worker

            self.worker = Worker(config, self.rank, rendezvous)
        except Exception as e:
            logger.exception("rank %d failed to start", self.rank)
            return _Reply(error=_describe(e), value_error=isinstance(e, ValueError), fatal=True)
        return _Reply()

    def call(self, seq: int, data: bytes, reply: bool) -> _Reply | None:
        """Run one pickled _Call; the reply where this rank answers it or where it failed a step."""
        if seq != self.next_seq:  # (never: one submitter's calls run in the order sent)
            return _Reply(error=f"call {seq} arrived before call {self.next_seq}", fatal=True)
        self.next_seq += 1
        answer = run_call(self.worker, self.rank, pickle.loads(data))
        return answer if reply or answer.fatal else None

    def wait_ended(self) -> None:
        """Never returns: the executor's watch on this actor, a call that fails when the actor ends."""
        threading.Event().wait()


class RayExecutor(RankCallExecutor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.world_size = config.parallel.world_size
        self._lock = threading.Lock()
        self._dead: WorkerDied | None = None
        self._closing = False
        self._seq = 0
        self._in_flight: set[Future[Any]] = set()
        self._outbox: queue.SimpleQueue[tuple[_Call, list[Future[Any]]] | None] = queue.SimpleQueue()
        # the actors' answers, as Ray's callbacks hand them over (nothing that calls Ray runs on its thread)
        self._answers: queue.SimpleQueue[tuple[int, Future[Any], Future[Any] | None] | None] = queue.SimpleQueue()
        self._actors: list[Any] = []
        self._where: list[tuple[str, int]] = []
        self._pg: PlacementGroup | None = None
        self._owns_ray = False
        self._watches: list[Future[Any]] = []
        try:
            self._connect()
            self._place()
            self._start_workers()
        except BaseException:
            self.shutdown()
            raise
        self._reader = threading.Thread(target=self._read_answers, name="tokenmill-ray-answers", daemon=True)
        self._reader.start()
        self._sender = threading.Thread(target=self._send_calls, name="tokenmill-ray-calls", daemon=True)
        self._sender.start()
        atexit.register(self.shutdown)

    @property
    def pids(self) -> list[int]:
        return [pid for _, pid in self._where]

    # ---- start-up -----------------------------------------------------------------------------------

    def _connect(self) -> None:
        if ray.is_initialized():  # the caller's connection: used, and left open at shutdown
            return
        address = os.environ.get("RAY_ADDRESS") or None
        if address is not None and address not in ("auto", "local"):
            _check_reachable(address)
        try:
            ray.init(address=address, logging_level=logging.WARNING, log_to_driver=True)
        except Exception as e:
            raise ValueError(f"cannot connect to the Ray cluster{f' at {address} (RAY_ADDRESS)' if address else ''}: "
                             f"{type(e).__name__}: {e}") from None
        self._owns_ray = True

    def _place(self) -> None:
        cfg = self.config
        cpus = cfg.parallel.threads_per_rank(cfg.device.num_threads or default_num_threads())
        bundle: dict[str, float] = {"CPU": cpus}
        if cfg.device.device == "cuda":
            bundle["GPU"] = 1
        have = ray.cluster_resources()
        for resource, each in bundle.items():
            if self.world_size * each > have.get(resource, 0):
                raise ValueError(
                    f"{self.world_size} ranks of {each:g} {resource} each need {self.world_size * each:g} {resource}; "
                    f"the Ray cluster has {have.get(resource, 0):g}: use fewer ranks, fewer --num-threads, "
                    f"or a bigger cluster")
        self._pg = placement_group([dict(bundle) for _ in range(self.world_size)], strategy="PACK",
                                   name=f"tokenmill-{os.getpid()}-{id(self)}")
        try:
            ray.get(self._pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except GetTimeoutError:
            raise ValueError(
                f"the Ray cluster did not place {self.world_size} ranks of {bundle} within "
                f"{PLACEMENT_TIMEOUT_S:g} s (its free resources: {ray.available_resources()}): free them, "
                f"or use fewer ranks or fewer --num-threads") from None
        remote: Any = ray.remote(concurrency_groups={_WATCH_GROUP: 1})(_RankActor)  # type: ignore[call-overload]
        level = logging.getLogger().getEffectiveLevel()
        for rank in range(self.world_size):
            strategy = PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=rank)
            self._actors.append(remote.options(
                name=None, num_cpus=cpus, num_gpus=bundle.get("GPU", 0), scheduling_strategy=strategy,
                max_restarts=0, max_task_retries=0).remote(rank, level))
        try:
            self._where = ray.get([a.where.remote() for a in self._actors])
        except RayActorError as e:
            raise RuntimeError(f"a Ray worker actor failed to start: {_first_line(e)}") from None

    def _start_workers(self) -> None:
        rendezvous = ray.get(self._actors[0].rendezvous_address.remote())
        starting = {a.start.remote(self.config, rendezvous): rank for rank, a in enumerate(self._actors)}
        waiting = list(starting)
        while waiting:  # the first rank that fails ends the start (the others would wait for it)
            done, waiting = ray.wait(waiting, num_returns=1)
            rank = starting[done[0]]
            try:
                reply: _Reply = ray.get(done[0])
            except RayActorError as e:
                raise WorkerDied(f"worker rank {rank} died while loading: {_first_line(e)}") from None
            if (error := reply_error(rank, reply)) is not None:
                raise error
        for rank, actor in enumerate(self._actors):
            watch = actor.wait_ended.options(concurrency_group=_WATCH_GROUP).remote().future()
            watch.add_done_callback(lambda f, rank=rank: self._answers.put((rank, f, None)))
            self._watches.append(watch)

    # ---- the Executor interface --------------------------------------------------------------------

    def shutdown(self) -> None:
        if self._closing:
            return
        self._closing = True
        atexit.unregister(self.shutdown)
        self._outbox.put(None)
        if hasattr(self, "_sender"):
            self._sender.join(5.0)
        self._answers.put(None)
        with self._lock:  # every later call fails at once
            self._dead = self._dead or WorkerDied("the executor has shut down")
        self._fail_in_flight(self._dead)
        if ray.is_initialized():
            for actor in self._actors:
                with contextlib.suppress(Exception):
                    ray.kill(actor, no_restart=True)
            if self._pg is not None:
                with contextlib.suppress(Exception):
                    remove_placement_group(self._pg)
            if self._owns_ray:
                ray.shutdown()

    # ---- calls and answers -------------------------------------------------------------------------

    def _post(self, call: _Call) -> list[Future[Any]]:
        if self._dead is not None:
            raise self._dead
        outers: list[Future[Any]] = [Future() for _ in range(call.reply_ranks)]
        with self._lock:
            self._in_flight.update(outers)
        for outer in outers:
            outer.add_done_callback(self._in_flight.discard)
        self._outbox.put((call, outers))
        return outers

    def _send_calls(self) -> None:
        while (item := self._outbox.get()) is not None:
            call, outers = item
            try:
                if self._dead is not None:
                    raise self._dead
                call = _with_bitmasks(call)
                data = pickle.dumps(call, protocol=pickle.HIGHEST_PROTOCOL)  # once, whatever the ranks
                seq, self._seq = self._seq, self._seq + 1
                answering = [rank for rank in range(self.world_size) if call.answered_by(rank)]
                outer_of = dict(zip(answering, outers, strict=True))
                for rank, actor in enumerate(self._actors):
                    answer = actor.call.remote(seq, data, rank in outer_of).future()
                    outer = outer_of.get(rank)
                    answer.add_done_callback(lambda f, rank=rank, outer=outer: self._answers.put((rank, f, outer)))
            except BaseException as e:  # (a dead executor; a bitmask that failed)
                for outer in outers:
                    if not outer.done():
                        outer.set_exception(e)

    def _read_answers(self) -> None:
        while (item := self._answers.get()) is not None:
            try:
                self._answered(*item)
            except Exception as e:  # (a bug here must not leave the engine waiting on its Futures)
                logger.exception("the executor's answer thread failed")
                with self._lock:
                    self._dead = self._dead or WorkerDied(f"the executor's answer thread failed: {e!r}")
                self._fail_in_flight(self._dead)

    def _answered(self, rank: int, answer: Future[Any], outer: Future[Any] | None) -> None:
        """A rank's answer to a call, or its watch's end: `outer`'s outcome, or the executor's end."""
        if (failure := answer.exception()) is not None:  # the actor is gone (or Ray lost the call)
            self._worker_died(rank, f"died: {_first_line(failure)}")
            return
        reply: _Reply | None = answer.result()
        if reply is not None and reply.fatal:
            # a peer's death fails this rank's collectives first: where an actor's watch fails within the
            # grace, that death is the cause to report
            wait(self._watches, timeout=_PEER_DEATH_GRACE_S, return_when=FIRST_EXCEPTION)
            dead = next((r for r, w in enumerate(self._watches) if w.done() and w.exception() is not None), None)
            if dead is not None and dead != rank:
                self._worker_died(dead, f"died: {_first_line(self._watches[dead].exception())}"  # type: ignore[arg-type]
                                  f" (rank {rank} then failed its step)")
            else:
                self._worker_died(rank, f"failed a step and was stopped: {reply.error}")
            return
        if outer is None or outer.done():
            return
        if reply is None:
            outer.set_result(None)
        elif (error := reply_error(rank, reply)) is not None:
            outer.set_exception(error)
        else:
            outer.set_result(reply.result)

    def _worker_died(self, rank: int, how: str) -> None:
        with self._lock:
            if self._closing or self._dead is not None:
                return
            host, pid = self._where[rank]
            error = self._dead = WorkerDied(f"worker rank {rank} (Ray actor, pid {pid} on {host}) {how}")
        logger.error("%s; stopping the other workers", error)
        for actor in self._actors:  # they cannot go on without it (their collectives would wait)
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        self._fail_in_flight(error)

    def _fail_in_flight(self, error: Exception) -> None:
        with self._lock:
            pending = list(self._in_flight)
            self._in_flight.clear()
        for f in pending:
            if not f.done():
                with contextlib.suppress(Exception):  # (set meanwhile by its answer)
                    f.set_exception(error)


def _check_reachable(address: str) -> None:
    """A ValueError unless something listens at the address's host:port."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"RAY_ADDRESS {address!r} is not host:port (or ray://host:port, auto, local)")
    try:
        socket.create_connection((host, int(port)), timeout=_CONNECT_TIMEOUT_S).close()
    except OSError as e:
        raise ValueError(f"the Ray cluster at {address} (RAY_ADDRESS) is not reachable: {e.strerror or e}; "
                         "start one (`ray start --head`) or unset RAY_ADDRESS to start a local one") from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"
