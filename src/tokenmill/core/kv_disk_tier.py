"""The disk tier of the KV cache: one file per prefix block, named by its chained block hash, written on a
thread of its own and bounded by its size (its own LRU, oldest files deleted first).

A file is a header, the block's token ids and its KV bytes (every group's, as the workers read them), then
an xxh3-64 of everything before it. A read checks the length, the header, the hash and tokens it was asked
for and the checksum; a file that fails any of them is deleted and the block is a miss (recomputed),
never used. The files live in a subdirectory named by the cache layout's fingerprint (model, dtype, block
size, bytes per block), so a directory shared by engines of other layouts never mixes their blocks; on
start the index is rebuilt from the files there, oldest access first, so a restarted engine finds them.
"""

from __future__ import annotations

import logging
import os
import queue
import struct
import threading
from array import array
from collections import OrderedDict

import xxhash

logger = logging.getLogger(__name__)

MAGIC = b"TMKVBLK1"
VERSION = 1
# magic, version, number of tokens, block hash, payload length
_HEADER = struct.Struct("<8sIIQQ")
_CHECKSUM = struct.Struct("<Q")
SUFFIX = ".kvb"
_WRITE_QUEUE = 1024  # blocks waiting for the writer thread; past that an offloaded block skips the disk


def encode_block(block_hash: int, token_ids: tuple[int, ...], payload: bytes) -> bytes:
    body = _HEADER.pack(MAGIC, VERSION, len(token_ids), block_hash, len(payload)) + array("q", token_ids).tobytes()
    body += payload
    return body + _CHECKSUM.pack(xxhash.xxh3_64_intdigest(body))


def decode_block(data: bytes, block_hash: int, token_ids: tuple[int, ...], payload_len: int) -> bytes | None:
    """The payload of a file's bytes if they are whole and hold this block, else None."""
    tokens_len = 8 * len(token_ids)
    if len(data) != _HEADER.size + tokens_len + payload_len + _CHECKSUM.size:
        return None  # truncated (or not this layout's)
    body, (checksum,) = data[:-_CHECKSUM.size], _CHECKSUM.unpack(data[-_CHECKSUM.size:])
    if xxhash.xxh3_64_intdigest(body) != checksum:
        return None
    magic, version, n_tokens, stored_hash, stored_len = _HEADER.unpack_from(body)
    if (magic, version, n_tokens, stored_hash, stored_len) != (MAGIC, VERSION, len(token_ids), block_hash,
                                                               payload_len):
        return None
    if array("q", body[_HEADER.size:_HEADER.size + tokens_len]).tolist() != list(token_ids):
        return None  # another prefix whose hash collides
    return body[_HEADER.size + tokens_len:]


class DiskTier:
    def __init__(self, directory: str, capacity_bytes: int, fingerprint: str, block_nbytes: int) -> None:
        self.directory = os.path.join(directory, fingerprint)
        os.makedirs(self.directory, exist_ok=True)
        self.capacity_bytes = capacity_bytes
        self.block_nbytes = block_nbytes
        self._lock = threading.Lock()  # the index and used_bytes: the writer thread and the scheduler's
        self._index: OrderedDict[int, int] = OrderedDict()  # block hash -> file size, least recently used first
        self._writing: set[int] = set()  # in the index (its bytes counted), its file not in place yet
        # queued for the writer: found by lookups meanwhile, so an evicted block is never out of both tiers
        self._queued: dict[int, tuple[tuple[int, ...], bytes]] = {}
        self.used_bytes = 0
        self.num_corrupt = 0  # files that failed a read's checks, deleted
        self.num_dropped = 0  # blocks the writer could not keep up with or write
        self._rebuild_index()
        self._queue: queue.Queue[tuple[int, tuple[int, ...], bytes] | None] = queue.Queue(_WRITE_QUEUE)
        self._closed = False
        self._thread = threading.Thread(target=self._write_loop, name="tokenmill-kv-disk", daemon=True)
        self._thread.start()

    def _path(self, block_hash: int) -> str:
        return os.path.join(self.directory, f"{block_hash:016x}{SUFFIX}")

    def _rebuild_index(self) -> None:
        found = []
        for entry in os.scandir(self.directory):
            if not entry.is_file():
                continue
            name = entry.name
            if not name.endswith(SUFFIX):  # a write that never finished
                os.unlink(entry.path)
                continue
            try:
                found.append((entry.stat().st_mtime_ns, int(name[:-len(SUFFIX)], 16), entry.stat().st_size))
            except ValueError:
                continue
        for _, block_hash, size in sorted(found):
            self._index[block_hash] = size
            self.used_bytes += size
        with self._lock:
            self._evict_to(self.capacity_bytes)  # restarted with a smaller size
        if found:
            logger.info("KV disk tier: %d blocks (%.1f MiB) found in %s", len(self._index), self.used_bytes / 2**20,
                        self.directory)

    def __contains__(self, block_hash: int) -> bool:
        with self._lock:
            return block_hash in self._queued or (block_hash in self._index and block_hash not in self._writing)

    def __len__(self) -> int:
        return len(self._index)

    def put(self, block_hash: int, token_ids: tuple[int, ...], payload: bytes) -> None:
        """Queue a block for the writer thread (a full queue drops it: a later miss recomputes it)."""
        with self._lock:
            if block_hash in self._queued or self._closed:
                return
            self._queued[block_hash] = (token_ids, payload)
        try:
            self._queue.put_nowait((block_hash, token_ids, payload))
        except queue.Full:
            self.num_dropped += 1
            with self._lock:
                del self._queued[block_hash]

    def get(self, block_hash: int, token_ids: tuple[int, ...]) -> bytes | None:
        """The block's KV bytes, checked; None where it is not here or its file fails a check (then deleted)."""
        with self._lock:
            queued = self._queued.get(block_hash)
            if queued is not None:
                return queued[1] if queued[0] == token_ids else None
            if block_hash not in self._index or block_hash in self._writing:
                return None
            self._index.move_to_end(block_hash)
        path = self._path(block_hash)
        try:
            with open(path, "rb") as f:
                data = f.read()
            os.utime(path)  # its place in the LRU, for the index a restart rebuilds
        except OSError:
            data = b""
        payload = decode_block(data, block_hash, token_ids, self.block_nbytes)
        if payload is None:
            self.num_corrupt += 1
            logger.warning("KV disk tier: %s failed its checks; deleted, the block is recomputed", path)
            with self._lock:
                self._forget(block_hash)
        return payload

    def flush(self) -> None:
        """Wait until every queued block is written."""
        self._queue.join()

    def close(self) -> None:
        """Write what is queued and stop the writer; later blocks are not kept."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join()

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._write(*item)
            except OSError as e:
                self.num_dropped += 1
                logger.warning("KV disk tier: a block could not be written: %s", e)
            finally:
                if item is not None:
                    with self._lock:
                        self._queued.pop(item[0], None)
                self._queue.task_done()

    def _write(self, block_hash: int, token_ids: tuple[int, ...], payload: bytes) -> None:
        data = encode_block(block_hash, token_ids, payload)
        with self._lock:
            if block_hash in self._index or len(data) > self.capacity_bytes:
                return
            self._evict_to(self.capacity_bytes - len(data))
            self.used_bytes += len(data)  # counted before it lands, so that the bound holds meanwhile
            self._index[block_hash] = len(data)
            self._writing.add(block_hash)
        path = self._path(block_hash)
        tmp = f"{path}.{threading.get_ident()}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)  # a reader sees the whole file or none
        except OSError:
            with self._lock:
                self._writing.discard(block_hash)
                self._forget(block_hash)
            raise
        with self._lock:
            self._writing.discard(block_hash)

    def _evict_to(self, limit: int) -> None:
        """Delete least recently used files until at most `limit` bytes are used (the lock held)."""
        while self._index and self.used_bytes > limit:
            block_hash = next(iter(self._index))
            self._forget(block_hash)

    def _forget(self, block_hash: int) -> None:
        size = self._index.pop(block_hash, None)
        if size is None:
            return
        self.used_bytes -= size
        try:
            os.unlink(self._path(block_hash))
        except FileNotFoundError:
            pass
