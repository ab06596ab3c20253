"""The scheduler's side of KV transfer (disaggregated prefill and decode): which blocks move, and when a
consumer's request may run. The bytes travel through a connector (tokenmill/kv_transfer/), which turns
the messages below into frames; the workers only read and write blocks (`SchedulerOutput.blocks_to_offload`
and `blocks_to_load`, the second KV tier's seams).

Producer: a request with `do_remote_decode` keeps its blocks once it has computed its prompt and sampled its
first token (`hold_kv`); a consumer asks for them (`KVPull`: the transfer id, the first block it lacks, its
block layout and the prompt's tokens, which must equal the producer's); the producer answers with a
`KVHeader` (the block count, the first token and its logprobs), then reads the blocks out a few per engine
step and sends each as its own `KVBlock` message; once the last one is sent, or the consumer is gone, or
nobody asked within `hold_timeout_s`, the blocks are freed.

Consumer: a request with `do_remote_prefill` takes its local prefix-cache hits and fresh blocks for the rest
of its prompt, leaves the waiting queue and asks the producer (pull: the consumer knows when it has room,
and the producer keeps nothing it is not asked for); each block that comes is queued to be written in
before the next step, while the other requests run. When the last one is in, the producer's first token is
appended and the request is queued as one whose prompt is computed: its next step decodes. A producer
that answers with an error, sends something that does not fit, or says nothing for `transfer_timeout_s`
makes the consumer free the blocks and compute the prompt itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.messages import LogprobEntry, SchedulerStats
from tokenmill.core.request import Request
from tokenmill.core.sched_output import ModelRunnerOutput, OffloadBlock, SchedulerOutput

# ---- the messages (msgpack; a block's bytes travel as a frame of their own) -------------------------------


class KVPull(msgspec.Struct, tag=True):
    """Consumer -> producer: send the blocks of transfer_id from first_block on."""

    transfer_id: str
    first_block: int
    block_size: int
    bytes_per_block: int
    prompt_token_ids: list[int]
    layout: str = ""  # the fingerprint of the consumer's cache layout (architecture, dtypes, block shape)


class KVRelease(msgspec.Struct, tag=True):
    """Consumer -> producer: the consumer will not pull transfer_id (it computes the prompt itself)."""

    transfer_id: str


class KVHeader(msgspec.Struct, tag=True):
    """Producer -> consumer, before the blocks: the prompt's block count and the token(s) it sampled."""

    transfer_id: str
    num_blocks: int
    first_token_ids: list[int]
    first_logprobs: list[LogprobEntry] | None = None


class KVBlock(msgspec.Struct, tag=True):
    """Producer -> consumer: one block's bytes follow (worker/kv_cache.py's read_blocks layout)."""

    transfer_id: str
    index: int


class KVError(msgspec.Struct, tag=True):
    """Producer -> consumer: the transfer cannot be served (unknown, expired, or the prompt differs)."""

    transfer_id: str
    message: str


KVMessage = KVPull | KVRelease | KVHeader | KVBlock | KVError


@dataclass
class Outgoing:
    """A message for the connector: to a producer's address (host, port), or back to a consumer (peer)."""

    message: KVMessage
    host: str = ""
    port: int = 0
    peer: bytes = b""
    payload: bytes = b""


@dataclass
class Incoming:
    message: KVMessage
    peer: bytes = b""  # the consumer's identity, for messages a producer receives
    payload: bytes = b""


# ---- state ----------------------------------------------------------------------------------------------


@dataclass
class _Held:
    """Producer: a finished prompt's kept blocks."""

    first_token_ids: list[int]
    first_logprobs: list[LogprobEntry] | None
    deadline: float
    peer: bytes | None = None  # the consumer pulling it
    queue: list[int] = field(default_factory=list)  # block indices still to read out
    in_flight: int = 0  # read out by steps whose output is not in yet


@dataclass
class _Pull:
    """Consumer: a request waiting for its blocks."""

    request: Request
    host: str
    port: int
    remote_id: str
    first_block: int
    block_ids: list[int]
    started: float
    deadline: float
    num_blocks: int | None = None
    first_token_ids: list[int] = field(default_factory=list)
    first_logprobs: list[LogprobEntry] | None = None
    received: set[int] = field(default_factory=set)


@dataclass
class PullDone:
    """A consumer request whose transfer ended: `ok` with the producer's first token(s), else to recompute."""

    request: Request
    ok: bool
    first_token_ids: list[int] = field(default_factory=list)
    first_logprobs: list[LogprobEntry] | None = None
    reason: str = ""


class KVTransfer:
    def __init__(self, kv: KVCacheManager, bytes_per_block: int, *, producer: bool, consumer: bool,
                 transfer_timeout_s: float, hold_timeout_s: float, blocks_per_step: int,
                 held_tokens: Callable[[str], list[int] | None], release: Callable[[str], None],
                 layout: str = "", clock: Callable[[], float] = time.monotonic) -> None:
        self.kv = kv
        self.block_size = kv.block_size
        self.bytes_per_block = bytes_per_block
        self.layout = layout  # producer and consumer must agree on it: same architecture, dtypes, block shape
        self.producer = producer
        self.consumer = consumer
        self.transfer_timeout_s = transfer_timeout_s
        self.hold_timeout_s = hold_timeout_s
        self.blocks_per_step = max(1, blocks_per_step)
        self._held_tokens = held_tokens  # the scheduler's kept tokens of a held request, None once released
        self._release = release  # frees a held request's blocks
        self.clock = clock
        self.held: dict[str, _Held] = {}
        self.pulls: dict[str, _Pull] = {}  # local request id -> its pull
        self._by_remote: dict[str, str] = {}  # remote transfer id -> local request id
        self._loads: list[tuple[str, int, bytes]] = []  # (request id, block id, bytes) for the next step
        self.outbox: list[Outgoing] = []
        self.done: list[PullDone] = []
        self.bytes_sent = 0
        self.bytes_received = 0
        self.seconds = 0.0
        self.blocks_received = 0
        self.failures = 0

    # ---- producer ---------------------------------------------------------------------------------------
    def produced(self, req: Request, logprobs: list[LogprobEntry] | None) -> None:
        """A do_remote_decode request finished with its blocks kept: hold them for a consumer."""
        self.held[req.request_id] = _Held(list(req.output_token_ids), logprobs,
                                          self.clock() + self.hold_timeout_s)

    def _refuse(self, peer: bytes, transfer_id: str, message: str, release: bool) -> None:
        self.outbox.append(Outgoing(KVError(transfer_id, message), peer=peer))
        if release:
            self._end_held(transfer_id)

    def _end_held(self, transfer_id: str) -> None:
        if self.held.pop(transfer_id, None) is not None:
            self._release(transfer_id)

    def on_pull(self, peer: bytes, pull: KVPull) -> None:
        tid = pull.transfer_id
        held = self.held.get(tid)
        tokens = self._held_tokens(tid)
        if not self.producer or held is None or tokens is None:
            self._refuse(peer, tid, f"transfer {tid!r} is unknown here or expired", held is not None)
            return
        if held.peer is not None:
            self._refuse(peer, tid, f"transfer {tid!r} is being pulled already", False)
            return
        if pull.block_size != self.block_size or pull.bytes_per_block != self.bytes_per_block:
            self._refuse(peer, tid, f"block layouts differ: the producer's blocks are {self.block_size} tokens, "
                                    f"{self.bytes_per_block} bytes; the consumer's {pull.block_size} tokens, "
                                    f"{pull.bytes_per_block} bytes (same model, dtype and --block-size?)", True)
            return
        if pull.layout != self.layout:
            self._refuse(peer, tid, "the KV cache layouts differ (model architecture, dtype or --kv-cache-dtype)",
                         True)
            return
        if pull.prompt_token_ids != tokens:
            self._refuse(peer, tid, "the consumer's prompt differs from the one the producer computed", True)
            return
        num_blocks = -(-len(tokens) // self.block_size)
        held.peer = peer
        held.queue = list(range(max(pull.first_block, 0), num_blocks))
        self.outbox.append(Outgoing(KVHeader(tid, num_blocks, held.first_token_ids, held.first_logprobs), peer=peer))
        if not held.queue:
            self._end_held(tid)

    def on_release(self, release: KVRelease) -> None:
        held = self.held.get(release.transfer_id)
        if held is not None and held.peer is None:
            self._end_held(release.transfer_id)

    def take_sends(self, limit: int | None = None) -> list[OffloadBlock]:
        """Blocks to read out in the step being scheduled, at most `limit` (default: blocks_per_step)."""
        limit = self.blocks_per_step if limit is None else limit
        out: list[OffloadBlock] = []
        for tid, held in list(self.held.items()):
            if not held.queue:
                continue
            blocks = self.kv.req_blocks.get(tid)
            if blocks is None or self._held_tokens(tid) is None:  # dropped under KV pressure
                assert held.peer is not None
                self._refuse(held.peer, tid, "the producer dropped the blocks", False)
                del self.held[tid]
                continue
            while held.queue and len(out) < limit:
                index = held.queue.pop(0)
                out.append(OffloadBlock(blocks[index].block_id, transfer_id=tid, index=index))
                held.in_flight += 1
            if len(out) >= limit:
                break
        return out

    def sent(self, so: SchedulerOutput, out: ModelRunnerOutput) -> None:
        """The bytes the workers read out for the step: one message per block."""
        sends = [(i, b) for i, b in enumerate(so.blocks_to_offload) if b.transfer_id is not None]
        if not sends:
            return
        if len(out.offloaded_kv) != len(so.blocks_to_offload):
            self.dropped(so)
            return
        for i, block in sends:
            assert block.transfer_id is not None
            held = self.held.get(block.transfer_id)
            if held is None or held.peer is None:
                continue
            payload = out.offloaded_kv[i]
            self.outbox.append(Outgoing(KVBlock(block.transfer_id, block.index), peer=held.peer, payload=payload))
            self.bytes_sent += len(payload)
            held.in_flight -= 1
            if not held.queue and not held.in_flight:  # the last one: the consumer has them all
                self._end_held(block.transfer_id)

    def dropped(self, so: SchedulerOutput) -> None:
        """A step that failed read nothing out: its transfers fail (their consumers compute the prompt)."""
        for tid in {b.transfer_id for b in so.blocks_to_offload if b.transfer_id is not None}:
            held = self.held.get(tid)
            if held is not None and held.peer is not None:
                self._refuse(held.peer, tid, "the producer's engine step failed", True)

    def peer_gone(self, transfer_id: str) -> None:
        """The connector could not reach the other side: a producer stops and frees the blocks; a consumer
        computes the prompt itself."""
        self._end_held(transfer_id)
        pull = self._pull_of(transfer_id)
        if pull is not None:
            self._fail(pull, f"cannot reach the producer at {pull.host}:{pull.port}", release=False)

    # ---- consumer ---------------------------------------------------------------------------------------
    def wants_pull(self, req: Request) -> bool:
        params = req.kv_transfer
        return (self.consumer and params is not None and params.do_remote_prefill and not req.kv_pulled
                and req.num_computed_tokens == 0 and not req.output_token_ids
                and req.sampling_params.prompt_logprobs is None
                and params.remote_request_id not in self._by_remote)

    def start_pull(self, req: Request, first_block: int) -> None:
        """req has its blocks (prefix hits, then fresh ones for the rest of the prompt): ask for the rest."""
        params = req.kv_transfer
        assert params is not None
        now = self.clock()
        req.kv_pulled = True
        self.pulls[req.request_id] = _Pull(req, params.remote_host, params.remote_port, params.remote_request_id,
                                           first_block, self.kv.block_ids(req.request_id), now,
                                           now + self.transfer_timeout_s)
        self._by_remote[params.remote_request_id] = req.request_id
        self.outbox.append(Outgoing(KVPull(params.remote_request_id, first_block, self.block_size,
                                           self.bytes_per_block, req.prompt_token_ids, self.layout),
                                    host=params.remote_host, port=params.remote_port))

    def release_remote(self, req: Request) -> None:
        """A do_remote_prefill request computed here after all: the producer may free its blocks."""
        params = req.kv_transfer
        if self.consumer and params is not None and params.do_remote_prefill and params.remote_port:
            self.outbox.append(Outgoing(KVRelease(params.remote_request_id), host=params.remote_host,
                                        port=params.remote_port))

    def is_pulling(self, request_id: str) -> bool:
        return request_id in self.pulls

    def _pull_of(self, transfer_id: str) -> _Pull | None:
        rid = self._by_remote.get(transfer_id)
        return self.pulls.get(rid) if rid is not None else None

    def on_header(self, header: KVHeader) -> None:
        pull = self._pull_of(header.transfer_id)
        if pull is None:
            return
        if pull.num_blocks is not None or header.num_blocks != len(pull.block_ids) or not header.first_token_ids:
            self._fail(pull, f"the producer's header does not fit ({header.num_blocks} blocks for "
                             f"{len(pull.block_ids)} here, first tokens {header.first_token_ids})")
            return
        pull.num_blocks = header.num_blocks
        pull.first_token_ids = list(header.first_token_ids)
        pull.first_logprobs = header.first_logprobs
        pull.deadline = self.clock() + self.transfer_timeout_s
        self._maybe_done(pull)

    def on_block(self, block: KVBlock, payload: bytes) -> None:
        pull = self._pull_of(block.transfer_id)
        if pull is None:
            return
        if (pull.num_blocks is None or not pull.first_block <= block.index < pull.num_blocks
                or block.index in pull.received or len(payload) != self.bytes_per_block):
            self._fail(pull, f"block {block.index} of {len(payload)} bytes does not fit (expected blocks "
                             f"{pull.first_block}..{pull.num_blocks} of {self.bytes_per_block} bytes)")
            return
        rid = pull.request.request_id
        self._loads.append((rid, pull.block_ids[block.index], payload))
        pull.received.add(block.index)
        self.bytes_received += len(payload)
        self.blocks_received += 1
        pull.deadline = self.clock() + self.transfer_timeout_s
        self._maybe_done(pull)

    def on_error(self, error: KVError) -> None:
        pull = self._pull_of(error.transfer_id)
        if pull is not None:
            self._fail(pull, f"the producer refused: {error.message}", release=False)

    def _maybe_done(self, pull: _Pull) -> None:
        if pull.num_blocks is None or len(pull.received) < pull.num_blocks - pull.first_block:
            return
        self._forget_pull(pull)
        self.seconds += self.clock() - pull.started
        self.done.append(PullDone(pull.request, True, pull.first_token_ids, pull.first_logprobs))

    def _fail(self, pull: _Pull, reason: str, release: bool = True) -> None:
        self._forget_pull(pull)
        self.drop_loads(pull.request.request_id)
        self.failures += 1
        if release:
            self.outbox.append(Outgoing(KVRelease(pull.remote_id), host=pull.host, port=pull.port))
        self.done.append(PullDone(pull.request, False, reason=reason))

    def _forget_pull(self, pull: _Pull) -> None:
        self.pulls.pop(pull.request.request_id, None)
        self._by_remote.pop(pull.remote_id, None)

    def cancel(self, request_id: str) -> None:
        """A pulling request ended (aborted): stop waiting for its blocks and tell the producer."""
        pull = self.pulls.get(request_id)
        if pull is not None:
            self._forget_pull(pull)
            self.drop_loads(request_id)
            self.outbox.append(Outgoing(KVRelease(pull.remote_id), host=pull.host, port=pull.port))

    def drop_loads(self, request_id: str) -> None:
        self._loads = [load for load in self._loads if load[0] != request_id]

    def take_loads(self) -> tuple[list[tuple[int, bytes]], list[str]]:
        """The blocks to write in before the step being scheduled, and whose they are."""
        loads, self._loads = self._loads, []
        return [(b, p) for _, b, p in loads], sorted({rid for rid, _, _ in loads})

    # ---- both ---------------------------------------------------------------------------------------------
    def receive(self, messages: list[Incoming]) -> None:
        for m in messages:
            msg = m.message
            if isinstance(msg, KVPull):
                self.on_pull(m.peer, msg)
            elif isinstance(msg, KVRelease):
                self.on_release(msg)
            elif isinstance(msg, KVHeader):
                self.on_header(msg)
            elif isinstance(msg, KVBlock):
                self.on_block(msg, m.payload)
            elif isinstance(msg, KVError):
                self.on_error(msg)

    def expire(self) -> bool:
        """Holds nobody pulled in time are freed; pulls the producer went quiet on fail. Whether any did."""
        now = self.clock()
        expired = False
        for tid, held in list(self.held.items()):
            if held.peer is None and now > held.deadline:
                self._end_held(tid)
                expired = True
        for pull in list(self.pulls.values()):
            if now > pull.deadline:
                self._fail(pull, f"no word from the producer at {pull.host}:{pull.port} for "
                                 f"{self.transfer_timeout_s:g}s")
                expired = True
        return expired

    def has_sends(self) -> bool:
        return any(h.queue for h in self.held.values())

    def take_outbox(self) -> list[Outgoing]:
        out, self.outbox = self.outbox, []
        return out

    def take_done(self) -> list[PullDone]:
        done, self.done = self.done, []
        return done

    def count_into(self, stats: SchedulerStats) -> None:
        stats.kv_transfer_bytes_sent = self.bytes_sent
        stats.kv_transfer_bytes_received = self.bytes_received
        stats.kv_transfer_seconds = self.seconds
        stats.kv_transfer_blocks_received = self.blocks_received
        stats.kv_transfer_failures = self.failures
