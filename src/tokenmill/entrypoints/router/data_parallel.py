"""`tokenmill serve --data-parallel-size N`: N engine-core replicas behind the one API process.

Each replica is a CoreClient and its own core process, with its own executor (its own ranks at
`--tensor-parallel-size` above one), scheduler and KV cache, and its share of `--num-threads` and of
`--kv-cache-memory` (`--num-kv-blocks`, where given, is each replica's). The API process tokenizes once
and hands each request (with its n children, which must meet in one step) to one replica, chosen by the
router's policy (entrypoints/router/pool.py, `prefix`): the replica holding the longest run of the
prompt's leading 16-token chunks, unless that puts it over the bound on imbalance, else the least
loaded. A beam-search step whose KV parent is held by a replica goes to that replica.

Outputs of every replica come out of `get_output` as one stream, their stats summed (each counter the
sum of the replicas', so /metrics reads as one engine). A replica that dies ends its own requests in
flight with an error naming it and leaves routing; the others serve on, `lost` says so (/health answers
503 with it); when none is left the client is `dead`, as a CoreClient whose core died.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import msgspec
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from tokenmill.config import EngineArgs, default_num_threads
from tokenmill.core.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, SchedulerStats, StepStats
from tokenmill.engine.core_client import CoreClient
from tokenmill.engine.wire import CoreReady, EngineDeadError
from tokenmill.entrypoints.router.affinity import TOKEN_CHUNK, prefix_hashes
from tokenmill.entrypoints.router.pool import Replica, ReplicaPool

logger = logging.getLogger(__name__)

MAX_PREFIX_CHUNKS = 256  # the leading chunks of a prompt that affinity looks at (4096 tokens)


@dataclasses.dataclass
class _Route:
    """One request's place: its replica and its children not yet finished."""
    index: int
    replica: Replica
    children: set[str]


def replica_args(args: EngineArgs, size: int, kv_cache_bytes: int) -> EngineArgs:
    """One replica's EngineArgs: a single replica, with its share of the threads (at least one) and of the
    KV cache bytes."""
    threads = args.num_threads or default_num_threads()
    share: dict[str, Any] = {"data_parallel_size": 1, "num_threads": max(1, threads // size)}
    if args.num_kv_blocks is None:
        share["kv_cache_memory"] = kv_cache_bytes // size
    return dataclasses.replace(args, **share)


class DataParallelClient:
    """N CoreClients as one (engine/core_client.EngineCoreClient). Use from one asyncio event loop."""

    def __init__(self, args: EngineArgs, log_level: str = "WARNING") -> None:
        config = args.create_engine_config()  # (the replicas' shares come from the whole's)
        self.size = config.parallel.data_parallel_size
        one = replica_args(args, self.size, config.cache.kv_cache_bytes)
        self.max_chunks = min(MAX_PREFIX_CHUNKS, config.model.max_model_len // TOKEN_CHUNK)
        self.pool = ReplicaPool("prefix")
        self.names = [str(i) for i in range(self.size)]
        self.dead: EngineDeadError | None = None
        self.lost: EngineDeadError | None = None
        self._death_callbacks: list[Callable[[EngineDeadError], None]] = []
        self._routes: dict[str, _Route] = {}  # child request id -> its route, until it finishes
        self._held: dict[str, int] = {}  # a finished request that keeps its KV blocks -> its replica
        self._stats: list[SchedulerStats | None] = [None] * self.size
        self._outputs: asyncio.Queue[EngineCoreOutputs] = asyncio.Queue()
        self._readers: list[asyncio.Task[None]] = []
        self.clients: list[CoreClient] = []
        try:
            for _ in range(self.size):
                self.clients.append(CoreClient(one, log_level))
        except BaseException:
            self.shutdown()
            raise
        for i, client in enumerate(self.clients):
            client.on_death(functools.partial(self._replica_died, i))

    @property
    def pid(self) -> int | None:
        return self.clients[0].pid

    @property
    def pids(self) -> list[int | None]:
        return [c.pid for c in self.clients]

    async def wait_ready(self) -> CoreReady:
        """Every replica loaded (they load side by side); the first failure raises ValueError naming it."""
        async def ready(i: int) -> CoreReady:
            try:
                return await self.clients[i].wait_ready()
            except ValueError as e:
                raise ValueError(f"data-parallel replica {i}: {e}") from None

        waits = [asyncio.ensure_future(ready(i)) for i in range(self.size)]
        try:
            readies = await asyncio.gather(*waits)
        finally:
            for w in waits:  # (the others' waits, after one failed)
                w.cancel()
        for i, client in enumerate(self.clients):
            self.pool.mark_ok(self.pool.replicas.setdefault(self.names[i], Replica(self.names[i])))
            self._readers.append(asyncio.get_running_loop().create_task(self._read(i, client)))
        return CoreReady(readies[0].pid, sum(r.num_blocks for r in readies), max(r.load_seconds for r in readies))

    def on_death(self, callback: Callable[[EngineDeadError], None]) -> None:
        self._death_callbacks.append(callback)

    # ---- requests ------------------------------------------------------------------------------

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        """One request's sequences, to one replica."""
        if self.dead is not None:
            raise self.dead
        hashes = prefix_hashes(requests[0].prompt_token_ids, self.max_chunks)
        parent = next((r.kv_parent for r in requests if r.kv_parent is not None), None)
        if parent is not None and parent in self._held:  # beam search: where its KV parent's blocks are
            replica = self.pool.replicas[self.names[self._held[parent]]]
            if not replica.healthy:
                raise EngineDeadError(f"data-parallel replica {replica.url}, which holds {parent!r}, is gone")
        else:
            chosen = self.pool.choose(hashes)
            if chosen is None:
                raise EngineDeadError("no data-parallel replica is serving")
            replica = chosen
        index = self.names.index(replica.url)
        self.clients[index].add_requests(requests)
        self.pool.started(replica, hashes)
        route = _Route(index, replica, {r.request_id for r in requests})
        for r in requests:
            self._routes[r.request_id] = route
            if r.hold_kv:
                self._held[r.request_id] = index

    def abort_requests(self, request_ids: list[str]) -> None:
        by_replica: dict[int, list[str]] = {}
        for rid in request_ids:
            route = self._routes.get(rid)
            held = self._held.pop(rid, None)
            index = route.index if route is not None else held
            if index is None:  # (finished, or never here): every replica, where it is nothing
                for i in range(self.size):
                    by_replica.setdefault(i, []).append(rid)
                continue
            by_replica.setdefault(index, []).append(rid)
            self._finished(rid)
        for i, ids in by_replica.items():
            if self.clients[i].dead is None:
                self.clients[i].abort_requests(ids)

    async def call_utility(self, method: str) -> Any:
        """The method on every replica still serving; a bool result is whether each said True."""
        live = [c for c in self.clients if c.dead is None]
        results = await asyncio.gather(*(c.call_utility(method) for c in live))
        if method == "reset_prefix_cache":
            for name in self.names:
                self.pool.affinity.forget(name)
        return all(results) if all(isinstance(r, bool) for r in results) else results

    async def get_output(self) -> EngineCoreOutputs:
        if self.dead is not None and self._outputs.empty():
            raise self.dead
        return await self._outputs.get()

    def shutdown(self, timeout: float = 5.0) -> None:
        self.dead = self.dead or EngineDeadError("the engine has shut down")
        for task in self._readers:
            task.cancel()
        for client in self.clients:
            try:
                client.shutdown(timeout)
            except Exception:  # (one replica's sockets must not keep the others running)
                logger.exception("data-parallel replica shutdown failed")

    # ---- outputs, load and deaths ---------------------------------------------------------------

    async def _read(self, index: int, client: CoreClient) -> None:
        try:
            while True:
                outs = await client.get_output()
                for out in outs.outputs:
                    if out.finished:
                        self._finished(out.request_id)
                if outs.stats is not None:
                    self._stats[index] = outs.stats
                    outs = msgspec.structs.replace(outs, stats=merge_stats(self._stats, index))
                self._outputs.put_nowait(outs)
        except EngineDeadError:
            return  # (its death callback ends its requests)

    def _finished(self, request_id: str) -> None:
        route = self._routes.pop(request_id, None)
        if route is None:
            return
        route.children.discard(request_id)
        if not route.children:
            self.pool.finished(route.replica)

    def _replica_died(self, index: int, error: EngineDeadError) -> None:
        name = self.names[index]
        replica = self.pool.replicas.get(name)
        if replica is not None:
            self.pool.mark_dead(replica)
            self.pool.affinity.forget(name)
        message = f"data-parallel replica {index} of {self.size} (engine core pid {self.clients[index].pid}): {error}"
        logger.error("%s; the other replicas serve on", message)
        stats = self._stats[index]
        if stats is not None:  # its last counters stay in the sums; it runs nothing any more
            self._stats[index] = msgspec.structs.replace(stats, num_running=0, num_waiting=0)
        ended = [rid for rid, route in self._routes.items() if route.index == index]
        for rid in ended:
            self._finished(rid)
        self._held = {rid: i for rid, i in self._held.items() if i != index}
        if ended:
            outputs = [EngineCoreOutput(rid, [], finish_reason="error", stop_reason=message) for rid in ended]
            self._outputs.put_nowait(EngineCoreOutputs(outputs, None, time.time()))
        self.lost = self.lost or EngineDeadError(message)
        if all(c.dead is not None for c in self.clients) and self.dead is None:
            self.dead = EngineDeadError(f"every data-parallel replica died (the first: {self.lost})")
            for callback in self._death_callbacks:
                callback(self.dead)

    def collector(self) -> Collector:
        return _ReplicaCollector(self)


def merge_stats(stats: list[SchedulerStats | None], latest: int) -> SchedulerStats:
    """The replicas' stats as one engine's: counters and gauges summed (the cache usage over all blocks);
    of the step counters, the cumulative ones summed and the last step's (`last_*`) from `latest`."""
    present = [s for s in stats if s is not None]
    merged = _sum_structs(present, stats[latest], SchedulerStats)
    total = merged.num_total_blocks
    used = sum(s.kv_cache_usage * s.num_total_blocks for s in present)
    steps = [s.step for s in present if s.step is not None]
    last = stats[latest]
    step = (_sum_structs(steps, last.step if last is not None else None, StepStats) if steps else None)
    return msgspec.structs.replace(merged, kv_cache_usage=used / total if total else 0.0, step=step)


def _sum_structs(items: list[Any], latest: Any, kind: Any) -> Any:
    values: dict[str, Any] = {}
    for field in msgspec.structs.fields(kind):
        name = field.name
        if name.startswith("last_"):
            values[name] = getattr(latest, name) if latest is not None else 0
            continue
        parts = [getattr(s, name) for s in items]
        if parts and all(isinstance(p, (int, float)) and not isinstance(p, bool) for p in parts):
            values[name] = sum(parts)
        elif parts and all(isinstance(p, list) for p in parts):
            values[name] = [sum(column) for column in _columns(parts)]
        elif parts and all(isinstance(p, dict) for p in parts):  # counts by key (structured output's kinds)
            values[name] = {key: sum(p.get(key, 0) for p in parts) for key in set().union(*parts)}
    return kind(**values)


def _columns(lists: list[list[int]]) -> Iterable[list[int]]:
    width = max(len(x) for x in lists)
    return ([x[i] if i < len(x) else 0 for x in lists] for i in range(width))


class _ReplicaCollector(Collector):
    """The replicas in /metrics: up or not, requests in flight and routed, and those routed by prefix."""

    def __init__(self, client: DataParallelClient) -> None:
        self.client = client

    def collect(self) -> Iterator[Any]:
        pool = self.client.pool
        up = GaugeMetricFamily("tokenmill:data_parallel_replica_up", "1 while the data-parallel replica serves",
                               labels=["replica"])
        running = GaugeMetricFamily("tokenmill:data_parallel_requests_running",
                                    "requests in flight on the data-parallel replica", labels=["replica"])
        routed = CounterMetricFamily("tokenmill:data_parallel_requests", "requests sent to the data-parallel "
                                     "replica", labels=["replica"])
        for name in self.client.names:
            replica = pool.replicas.get(name)
            up.add_metric([name], 1.0 if replica is not None and replica.healthy else 0.0)
            running.add_metric([name], replica.in_flight if replica is not None else 0)
            routed.add_metric([name], replica.routed if replica is not None else 0)
        yield from (up, running, routed)
        yield CounterMetricFamily("tokenmill:data_parallel_prefix_routed", "requests sent to the replica holding "
                                  "their prompt's prefix", value=pool.prefix_routed)
