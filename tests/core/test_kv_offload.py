"""The second KV tier's store, without an engine: the disk tier's file checks, its bound and its index
after a restart; the memory tier's LRU bound and the swap reservations it never evicts."""

from __future__ import annotations

import os
from typing import Any

import pytest

from tokenmill.core.kv_disk_tier import SUFFIX, DiskTier, decode_block, encode_block
from tokenmill.core.kv_offload import DISK, MEMORY, KVOffloadStore

NBYTES = 256
TOKENS = tuple(range(8))
FILE_BYTES = len(encode_block(1, TOKENS, bytes(NBYTES)))


def payload(i: int) -> bytes:
    return bytes((i + j) % 256 for j in range(NBYTES))


def disk(root: Any, capacity: int = 100 * FILE_BYTES, fingerprint: str = "layout") -> DiskTier:
    return DiskTier(str(root), capacity, fingerprint, NBYTES)


def files(root: Any) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, names in os.walk(root) for f in names if f.endswith(SUFFIX))


def test_a_block_file_is_checked_whole() -> None:
    data = encode_block(7, TOKENS, payload(1))
    assert decode_block(data, 7, TOKENS, NBYTES) == payload(1)
    assert decode_block(data[:-1], 7, TOKENS, NBYTES) is None  # truncated
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 1
    assert decode_block(bytes(flipped), 7, TOKENS, NBYTES) is None  # the checksum
    assert decode_block(data, 8, TOKENS, NBYTES) is None  # another block's hash
    assert decode_block(data, 7, (9,) * 8, NBYTES) is None  # a hash collision: other tokens
    assert decode_block(data, 7, TOKENS, NBYTES + 8) is None  # another layout's block size


def test_disk_tier_writes_on_its_thread_and_reads_back(tmp_path: Any) -> None:
    tier = disk(tmp_path)
    for i in range(5):
        tier.put(i, TOKENS, payload(i))
    assert all(i in tier for i in range(5))  # queued blocks are found before they are written
    tier.flush()
    assert len(files(tmp_path)) == 5 and tier.used_bytes == 5 * FILE_BYTES
    assert tier.get(3, TOKENS) == payload(3)
    assert tier.get(3, (1,) * 8) is None and tier.get(99, TOKENS) is None
    tier.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty"])
def test_damaged_files_are_refused_and_deleted(tmp_path: Any, damage: str) -> None:
    tier = disk(tmp_path)
    tier.put(1, TOKENS, payload(1))
    tier.put(2, TOKENS, payload(2))
    tier.close()
    path = files(tmp_path)[0]
    with open(path, "r+b") as f:
        if damage == "flip":
            f.seek(FILE_BYTES - 20)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
        else:
            f.truncate(FILE_BYTES - 1 if damage == "truncate" else 0)
    tier = disk(tmp_path)  # the index holds both: files are checked when read
    assert 1 in tier and 2 in tier
    assert tier.get(1, TOKENS) is None and tier.num_corrupt == 1
    assert 1 not in tier and not os.path.exists(path) and tier.used_bytes == FILE_BYTES
    assert tier.get(2, TOKENS) == payload(2)
    tier.close()


def test_disk_tier_stays_within_its_size_least_recently_used_out(tmp_path: Any) -> None:
    tier = disk(tmp_path, capacity=4 * FILE_BYTES + 10)
    for i in range(3):
        tier.put(i, TOKENS, payload(i))
    tier.flush()
    assert tier.get(0, TOKENS) == payload(0)  # 0 is now the most recently used
    for i in range(3, 7):
        tier.put(i, TOKENS, payload(i))
        tier.flush()
        assert sum(os.path.getsize(f) for f in files(tmp_path)) <= 4 * FILE_BYTES + 10
    assert [i for i in range(7) if i in tier] == [3, 4, 5, 6]
    tier.put(7, TOKENS, b"x" * (5 * FILE_BYTES))  # bigger than the tier: never written
    tier.close()
    assert len(files(tmp_path)) == 4


def test_a_restart_rebuilds_the_index_oldest_first_and_smaller_sizes_evict(tmp_path: Any) -> None:
    tier = disk(tmp_path)
    for i in range(4):
        tier.put(i, TOKENS, payload(i))
        tier.flush()
        os.utime(os.path.join(tier.directory, f"{i:016x}{SUFFIX}"), ns=(i * 10**9, i * 10**9))
    tier.close()
    with open(os.path.join(tmp_path, "layout", f"{5:016x}{SUFFIX}.123.tmp"), "wb") as f:
        f.write(b"half a write")
    again = disk(tmp_path, capacity=3 * FILE_BYTES)  # smaller now: the oldest file goes
    assert [i for i in range(4) if i in again] == [1, 2, 3] and again.get(2, TOKENS) == payload(2)
    assert not any(name.endswith(".tmp") for name in os.listdir(again.directory))
    other = disk(tmp_path, fingerprint="another-layout")  # another model or cache layout sees none of them
    assert len(other) == 0
    again.close()
    other.close()


def test_memory_tier_is_an_lru_within_its_bytes_and_asked_first(tmp_path: Any) -> None:
    store = KVOffloadStore(NBYTES, memory_bytes=3 * NBYTES, disk=disk(tmp_path))
    for i in range(4):
        store.put(i, TOKENS, payload(i))
    store.disk.flush()  # type: ignore[union-attr]
    assert store.memory_used_bytes == 3 * NBYTES
    assert store.get(3, TOKENS) == payload(3) and store.counters.hits == {MEMORY: 1, DISK: 0}
    assert store.get(0, TOKENS) == payload(0) and store.counters.hits == {MEMORY: 1, DISK: 1}  # evicted: disk
    assert store.get(0, (5,) * 8) is None
    assert store.counters.bytes_offloaded == 4 * NBYTES and store.counters.bytes_loaded == 2 * NBYTES
    store.close()


def test_swap_reservations_are_never_evicted() -> None:
    store = KVOffloadStore(NBYTES, memory_bytes=4 * NBYTES)
    for i in range(4):
        store.put(i, TOKENS, payload(i))
    assert store.reserve_swap("a", 3)  # prefix blocks make room
    assert not store.contains(0) and store.contains(3)
    assert not store.reserve_swap("b", 2)  # only one block left: b is recomputed
    store.put(9, TOKENS, payload(9))  # a prefix block fits beside the reservation, evicting 3
    assert store.contains(9) and not store.contains(3)
    store.put(10, TOKENS, payload(10))
    assert store.memory_used_bytes == 4 * NBYTES
    store.put_swap("a", [payload(i) for i in range(3)])
    assert store.has_swap("a") and store.take_swap("a") == [payload(i) for i in range(3)]
    assert store.swap_reserved_bytes == 0 and store.reserve_swap("b", 2)
    store.drop_swap("b")
    assert store.swap_reserved_bytes == 0


def test_a_tier_smaller_than_a_block_is_refused(tmp_path: Any) -> None:
    with pytest.raises(ValueError, match="holds no KV block"):
        KVOffloadStore(NBYTES, memory_bytes=NBYTES - 1)
    with pytest.raises(ValueError, match="kv_offload_disk_size"):
        KVOffloadStore(NBYTES, disk=disk(tmp_path, capacity=NBYTES - 1))
