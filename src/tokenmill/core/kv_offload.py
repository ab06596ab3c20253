"""The second tier of the KV cache: host memory (`--kv-offload-memory`) and local disk (`--kv-offload-disk`).

Pure Python over bytes: the workers read a block's KV out of the first tier into bytes and write bytes
back into a block (worker/kv_cache.py); this store keeps them. Prefix blocks evicted from the first tier
are kept by their chained block hash (with their token ids, which a lookup compares), in the memory tier
(an LRU bounded by its bytes) and in the disk tier (written on its own thread, core/kv_disk_tier.py);
a lookup asks memory first. A request preempted with `--preemption-mode swap` keeps its blocks here until
it resumes: its bytes are reserved in the memory tier when it is preempted (prefix blocks are evicted to
make room; no room means the request is recomputed instead) and never evicted.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass

import xxhash

from tokenmill.config import EngineConfig
from tokenmill.core.kv_disk_tier import DiskTier

MEMORY, DISK = "memory", "disk"


@dataclass
class TierCounters:
    """Cumulative: blocks found per tier, bytes moved each way, disk blocks that failed their checks."""

    hits: dict[str, int]
    bytes_offloaded: int = 0  # first tier -> second (prefix blocks and swapped requests)
    bytes_loaded: int = 0  # second tier -> first


class KVOffloadStore:
    def __init__(self, block_nbytes: int, memory_bytes: int = 0, disk: DiskTier | None = None) -> None:
        if memory_bytes and memory_bytes < block_nbytes:
            raise ValueError(f"kv_offload_memory ({memory_bytes} bytes) holds no KV block ({block_nbytes} bytes); "
                             "raise it")
        if disk is not None and disk.capacity_bytes < block_nbytes:
            disk.close()
            raise ValueError(f"kv_offload_disk_size ({disk.capacity_bytes} bytes) holds no KV block "
                             f"({block_nbytes} bytes); raise it")
        self.block_nbytes = block_nbytes
        self.memory_bytes = memory_bytes
        self.disk = disk
        self._memory: OrderedDict[int, tuple[tuple[int, ...], bytes]] = OrderedDict()  # LRU, oldest first
        self._memory_used = 0
        self._swap_reserved: dict[str, int] = {}  # request id -> bytes held for its swapped blocks
        self._swapped: dict[str, list[bytes]] = {}
        self.counters = TierCounters({MEMORY: 0, DISK: 0})

    # ---- prefix blocks, by hash -----------------------------------------------------------------
    def contains(self, block_hash: int) -> bool:
        return block_hash in self._memory or (self.disk is not None and block_hash in self.disk)

    def put(self, block_hash: int, token_ids: tuple[int, ...], payload: bytes) -> None:
        self.counters.bytes_offloaded += len(payload)
        if self.memory_bytes and block_hash not in self._memory and self._make_room(len(payload)):
            self._memory[block_hash] = (token_ids, payload)
            self._memory_used += len(payload)
        if self.disk is not None and block_hash not in self.disk:
            self.disk.put(block_hash, token_ids, payload)

    def get(self, block_hash: int, token_ids: tuple[int, ...]) -> bytes | None:
        """The block's bytes from the fastest tier that has it whole (a disk read is checked), else None."""
        entry = self._memory.get(block_hash)
        if entry is not None and entry[0] == token_ids:
            self._memory.move_to_end(block_hash)
            return self._hit(MEMORY, entry[1])
        payload = self.disk.get(block_hash, token_ids) if self.disk is not None else None
        return self._hit(DISK, payload) if payload is not None else None

    def _hit(self, tier: str, payload: bytes) -> bytes:
        self.counters.hits[tier] += 1
        self.counters.bytes_loaded += len(payload)
        return payload

    def _make_room(self, nbytes: int) -> bool:
        """Evict the memory tier's least recently used prefix blocks until nbytes more fit beside the
        swapped requests' reservations; False where they cannot."""
        limit = self.memory_bytes - self.swap_reserved_bytes - nbytes
        if limit < 0:
            return False
        while self._memory_used > limit:
            _, (_, payload) = self._memory.popitem(last=False)
            self._memory_used -= len(payload)
        return True

    # ---- swapped requests, by request id ---------------------------------------------------------
    def reserve_swap(self, request_id: str, num_blocks: int) -> bool:
        """Room for a preempted request's blocks in the memory tier, held until it resumes or ends."""
        nbytes = num_blocks * self.block_nbytes
        if not self.memory_bytes or not self._make_room(nbytes):
            return False
        self._swap_reserved[request_id] = nbytes
        return True

    def put_swap(self, request_id: str, blocks: list[bytes]) -> None:
        if request_id in self._swap_reserved:
            self._swapped[request_id] = blocks
            self.counters.bytes_offloaded += sum(len(b) for b in blocks)

    def has_swap(self, request_id: str) -> bool:
        return request_id in self._swapped

    def take_swap(self, request_id: str) -> list[bytes]:
        blocks = self._swapped.pop(request_id)
        self._swap_reserved.pop(request_id, None)
        self.counters.bytes_loaded += sum(len(b) for b in blocks)
        return blocks

    def drop_swap(self, request_id: str) -> None:
        self._swapped.pop(request_id, None)
        self._swap_reserved.pop(request_id, None)

    @property
    def num_memory_blocks(self) -> int:
        """Prefix blocks held in the memory tier."""
        return len(self._memory)

    @property
    def memory_used_bytes(self) -> int:
        """Prefix blocks' bytes and swapped requests' reservations in the memory tier."""
        return self._memory_used + self.swap_reserved_bytes

    @property
    def swap_reserved_bytes(self) -> int:
        return sum(self._swap_reserved.values())

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()


def kv_layout_fingerprint(config: EngineConfig, block_nbytes: int, *more: str) -> str:
    """A hash of what makes one engine's KV block bytes readable by another: the architecture, the model
    and cache dtypes, the block size and bytes (and `more`, e.g. the model's path)."""
    parts = (*more, config.model.arch, config.model.dtype, config.cache.kv_cache_dtype, config.cache.block_size,
             block_nbytes)
    return xxhash.xxh3_64_hexdigest("|".join(map(str, parts)).encode())


def kv_offload_store(config: EngineConfig, block_nbytes: int) -> KVOffloadStore | None:
    """The store the config asks for (None: no second tier). The disk tier's files are kept apart by the
    layout's fingerprint: the model directory and architecture, the cache's dtype, block size and bytes."""
    cache = config.cache
    if not cache.kv_offload_memory_bytes and cache.kv_offload_disk is None:
        return None
    disk = None
    if cache.kv_offload_disk is not None:
        disk = DiskTier(cache.kv_offload_disk, cache.kv_offload_disk_bytes,
                        kv_layout_fingerprint(config, block_nbytes, os.path.abspath(config.model.model)), block_nbytes)
    return KVOffloadStore(block_nbytes, cache.kv_offload_memory_bytes, disk)
