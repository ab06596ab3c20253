"""Which replica holds a prompt's prefix: a bounded map from chained chunk hashes to the replica
that last served them (the router's picture of each replica's prefix cache).

A prompt is cut into fixed chunks (characters of text, or token ids) and hashed as a chain, so
the i-th hash names the whole prefix up to chunk i, as the engine's block hashes do. The longest
run of leading hashes that one replica holds is that replica's match."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import xxhash

TEXT_CHUNK_CHARS = 64  # about 16 tokens of English text
TOKEN_CHUNK = 16


def prefix_hashes(key: str | Sequence[int], max_chunks: int) -> list[int]:
    """The chained hashes of the key's whole leading chunks (a trailing partial chunk is left out)."""
    if isinstance(key, str):
        data = key.encode("utf-8", "surrogatepass")
        step = TEXT_CHUNK_CHARS
    else:
        data = b"".join(int(t).to_bytes(8, "little", signed=True) for t in key)
        step = TOKEN_CHUNK * 8
    hashes: list[int] = []
    parent = 0
    for start in range(0, min(len(data) // step, max_chunks) * step, step):
        parent = xxhash.xxh64_intdigest(data[start:start + step], seed=parent)
        hashes.append(parent)
    return hashes


class PrefixAffinity:
    """Chained prefix hash -> the replicas holding it, least recently used hash first out past
    `capacity` entries."""

    def __init__(self, capacity: int = 200_000) -> None:
        if capacity <= 0:
            raise ValueError("the affinity table needs a positive capacity")
        self.capacity = capacity
        self._owners: OrderedDict[int, set[str]] = OrderedDict()
        self._held: dict[str, int] = {}  # replica -> how many hashes name it among their owners

    def __len__(self) -> int:
        return len(self._owners)

    def matches(self, hashes: Sequence[int]) -> dict[str, int]:
        """Per replica, how many leading chunks of the prompt it holds (replicas holding none are absent).
        A match is a run from the first chunk: a chained hash at depth i stands for the whole prefix."""
        found: dict[str, int] = {}
        live: set[str] | None = None
        for depth, h in enumerate(hashes, start=1):
            owners = self._owners.get(h)
            live = set(owners or ()) if live is None else live & (owners or set())
            if not live:
                break
            for replica in live:
                found[replica] = depth
        return found

    def held(self, replica: str) -> int:
        """How many prefix chunks the table says the replica holds (its share of the cached prefixes)."""
        return self._held.get(replica, 0)

    def record(self, hashes: Sequence[int], replica: str) -> None:
        """The replica now holds these prefixes (it just served the prompt)."""
        for h in hashes:
            owners = self._owners.setdefault(h, set())
            if replica not in owners:
                owners.add(replica)
                self._held[replica] = self._held.get(replica, 0) + 1
            self._owners.move_to_end(h)
        while len(self._owners) > self.capacity:
            _, owners = self._owners.popitem(last=False)
            for r in owners:
                self._held[r] -= 1

    def forget(self, replica: str) -> None:
        """A replica left (or restarted with an empty cache): it holds nothing."""
        for h in list(self._owners):
            owners = self._owners[h]
            owners.discard(replica)
            if not owners:
                del self._owners[h]
        self._held.pop(replica, None)
