"""Token bitmasks in xgrammar's layout (core/structured_output.py): int32 words, token t at bit t % 32
of word t // 32."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from tokenmill.core.structured_output import BITS_PER_WORD, bitmask_words


def pack_allowed(allowed: Iterable[int], vocab_size: int) -> np.ndarray:
    """One position's bitmask ([words] int32) allowing exactly the given token ids."""
    bits = np.zeros(bitmask_words(vocab_size) * BITS_PER_WORD, dtype=np.uint8)
    bits[np.fromiter(allowed, dtype=np.int64)] = 1
    return np.packbits(bits, bitorder="little").view("<i4").astype(np.int32)


def allowed_ids(bitmask: np.ndarray) -> np.ndarray:
    """The token ids one position's bitmask ([words] int32) allows."""
    return np.flatnonzero(np.unpackbits(bitmask.astype("<i4").view(np.uint8), bitorder="little"))
