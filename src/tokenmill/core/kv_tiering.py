"""The scheduler's side of the second KV tier: which blocks move between the tiers in each step.

Out: a prefix-cached block the pool evicts (and that the second tier lacks) is read out by the workers
before the step that reuses it runs, and its bytes join the store when that step's output is in; so
does a request preempted with `--preemption-mode swap` (all its blocks with computed, known tokens),
which waits until its bytes are in. In: a waiting request whose next prefix blocks miss the first tier
but are in the second gets fresh blocks and their bytes, written in before its step runs; a swapped
request gets all its blocks back and resumes where it was. A disk block that fails its checks ends the
run of loaded blocks there: the rest are computed.
"""

from __future__ import annotations

from tokenmill.core.block_pool import KVBlock
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.kv_offload import DISK, MEMORY, KVOffloadStore
from tokenmill.core.messages import SchedulerStats
from tokenmill.core.request import Request
from tokenmill.core.sched_output import ModelRunnerOutput, OffloadBlock, SchedulerOutput


class KVTiering:
    def __init__(self, kv: KVCacheManager, store: KVOffloadStore, swap: bool) -> None:
        self.kv = kv
        self.store = store
        self.swap = swap  # preemption swaps a request's blocks out instead of dropping them
        self.block_size = kv.block_size
        kv.pool.on_evict = self._evicted
        self._offloads: list[OffloadBlock] = []  # for the step being scheduled
        self._loads: list[tuple[int, bytes]] = []
        self._swapping_out: dict[str, int] = {}  # request id -> tokens its blocks hold, bytes not in yet
        self._swapped: dict[str, int] = {}  # request id -> tokens its swapped blocks hold (bytes in the store)
        self.num_swapped_out = 0  # cumulative
        self.num_swapped_in = 0

    def _evicted(self, block: KVBlock) -> None:
        assert block.block_hash is not None and block.token_ids is not None
        if not self.store.contains(block.block_hash):
            self._offloads.append(OffloadBlock(block.block_id, block.block_hash, block.token_ids))

    # ---- scheduling --------------------------------------------------------------------------------
    def waits_for_swap(self, req: Request) -> bool:
        """Whether req was swapped out by a step whose output (its blocks' bytes) is not in yet."""
        return req.request_id in self._swapping_out

    def is_swapped(self, req: Request) -> bool:
        return req.request_id in self._swapped

    def loadable_tokens(self, req: Request, num_tier1_blocks: int) -> int:
        """Tokens after the first tier's hits whose KV the second tier holds (its index only: nothing is
        read until the blocks are allocated); at least one token is always left to compute."""
        last = req.num_tokens - 1
        if req.request_id in self._swapped:
            n = min(self._swapped[req.request_id], last)
            if n <= 0:
                self.forget(req.request_id)
            return max(n, 0)
        hashes = req.block_hashes[num_tier1_blocks:last // self.block_size]
        if not self.kv.enable_caching or req.sampling_params.prompt_logprobs is not None:
            return 0
        k = 0
        for block_hash in hashes:
            if not self.store.contains(block_hash):
                break
            k += 1
        return k * self.block_size

    def load(self, req: Request, first_block: int, num_tokens: int) -> int:
        """Queue the loads of req's blocks from index first_block on, covering num_tokens (allocated already);
        returns the tokens whose KV is loaded (fewer where a disk block fails its checks)."""
        blocks = self.kv.req_blocks[req.request_id][first_block:]
        if req.request_id in self._swapped:
            del self._swapped[req.request_id]
            payloads = self.store.take_swap(req.request_id)
            n_blocks = -(-num_tokens // self.block_size)
            self._loads += [(b.block_id, p) for b, p in zip(blocks[:n_blocks], payloads, strict=False)]
            self.num_swapped_in += 1
            return num_tokens
        tokens = req.all_token_ids
        loaded = 0
        for i in range(num_tokens // self.block_size):
            start = (first_block + i) * self.block_size
            payload = self.store.get(req.block_hashes[first_block + i], tuple(tokens[start:start + self.block_size]))
            if payload is None:
                break
            self._loads.append((blocks[i].block_id, payload))
            loaded += self.block_size
        return loaded

    def swap_out(self, req: Request) -> bool:
        """Queue the read-out of a request being preempted (its blocks are freed after this); False where
        swapping is off, the memory tier has no room or the request wants prompt logprobs: then it is
        recomputed."""
        n = min(req.num_computed_tokens, req.num_tokens)
        blocks = self.kv.req_blocks.get(req.request_id, [])[:-(-n // self.block_size)]
        if (not self.swap or n <= 0 or not blocks or req.sampling_params.prompt_logprobs is not None
                or not self.store.reserve_swap(req.request_id, len(blocks))):
            return False  # (prompt logprobs are computed again with the prompt's KV)
        self._offloads += [OffloadBlock(b.block_id, request_id=req.request_id) for b in blocks]
        self._swapping_out[req.request_id] = n
        self.num_swapped_out += 1
        return True

    def take(self) -> tuple[list[OffloadBlock], list[tuple[int, bytes]]]:
        """The moves of the step just scheduled, for its SchedulerOutput."""
        moves = self._offloads, self._loads
        self._offloads, self._loads = [], []
        return moves

    # ---- after the step ------------------------------------------------------------------------------
    def absorb(self, so: SchedulerOutput, out: ModelRunnerOutput) -> None:
        """The bytes the workers read out for the step: prefix blocks into the store, swapped requests'
        blocks into their reservations (then they may resume)."""
        if not so.blocks_to_offload:
            return
        if len(out.offloaded_kv) != len(so.blocks_to_offload):
            self.drop(so)
            return
        swapped: dict[str, list[bytes]] = {}
        for block, payload in zip(so.blocks_to_offload, out.offloaded_kv, strict=True):
            if block.request_id is not None:
                swapped.setdefault(block.request_id, []).append(payload)
            elif block.block_hash is not None:
                self.store.put(block.block_hash, block.token_ids, payload)
        for rid, payloads in swapped.items():
            n = self._swapping_out.pop(rid, None)
            if n is not None:  # else it ended meanwhile
                self.store.put_swap(rid, payloads)
                self._swapped[rid] = n

    def drop(self, so: SchedulerOutput) -> None:
        """A step that failed brings no bytes: its swapped requests are recomputed instead."""
        for block in so.blocks_to_offload:
            if block.request_id is not None and self._swapping_out.pop(block.request_id, None) is not None:
                self.store.drop_swap(block.request_id)

    def forget(self, request_id: str) -> None:
        """A request that ended (or is recomputed after all) gives its swap space back."""
        self._swapping_out.pop(request_id, None)
        self._swapped.pop(request_id, None)
        self.store.drop_swap(request_id)

    def count_into(self, stats: SchedulerStats) -> None:
        counters = self.store.counters
        stats.kv_offload_memory_hits = counters.hits[MEMORY] * self.block_size
        stats.kv_offload_disk_hits = counters.hits[DISK] * self.block_size
        stats.kv_offload_bytes_offloaded = counters.bytes_offloaded
        stats.kv_offload_bytes_loaded = counters.bytes_loaded
        stats.kv_offload_corrupt_blocks = self.store.disk.num_corrupt if self.store.disk is not None else 0
        stats.num_swapped_out = self.num_swapped_out
        stats.num_swapped_in = self.num_swapped_in
        store = self.store
        stats.kv_offload_memory_blocks = store.num_memory_blocks
        stats.kv_offload_memory_swap_blocks = store.swap_reserved_bytes // store.block_nbytes
        stats.kv_offload_memory_used_bytes = store.memory_used_bytes
        stats.kv_offload_memory_capacity_bytes = store.memory_bytes
        if store.disk is not None:
            stats.kv_offload_disk_blocks = len(store.disk)
            stats.kv_offload_disk_used_bytes = store.disk.used_bytes
            stats.kv_offload_disk_capacity_bytes = store.disk.capacity_bytes
