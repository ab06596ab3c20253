"""Chained block hashes for automatic prefix caching."""

from __future__ import annotations

from array import array

import xxhash

ROOT_HASH = 0


def hash_block(parent_hash: int, token_ids: tuple[int, ...] | list[int], extra: bytes = b"") -> int:
    """A block's key: its parent's hash, its tokens and any extra keys, so equal keys mean
    equal prefixes (up to collisions, which lookups rule out by comparing token ids)."""
    h = xxhash.xxh3_64()
    h.update(parent_hash.to_bytes(8, "little"))
    h.update(array("q", token_ids).tobytes())
    if extra:
        h.update(extra)
    return h.intdigest()


def extend_block_hashes(hashes: list[int], token_ids: list[int], block_size: int, upto: int) -> None:
    """Append the hashes of every full block in token_ids[:upto] not hashed yet."""
    n_full = min(upto, len(token_ids)) // block_size
    for i in range(len(hashes), n_full):
        parent = hashes[i - 1] if i else ROOT_HASH
        hashes.append(hash_block(parent, token_ids[i * block_size:(i + 1) * block_size]))
