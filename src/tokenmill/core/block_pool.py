"""The pool of KV blocks: reference counts, the free blocks, and the prefix-cache index.

A free block that holds cached KV keeps its hash until it is handed out again: such blocks form
an LRU, oldest first, and allocation evicts from its front only when no blank block is left.
Blank free blocks (no cached content) are handed out most recently freed first, so a working
set of memory that has been written before is reused before memory the OS has never backed
(a first write to a fresh page costs a page fault; bench/README.md, "Measurements behind the code").
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None

    def __repr__(self) -> str:
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVBlock] = OrderedDict()  # free with cached KV, LRU order
        # free without cached KV, a stack (the last is handed out first): block 0 on top at start
        self._blank: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in reversed(self.blocks))
        self._cached: dict[int, KVBlock] = {}
        self.peak_used_blocks = 0  # the most blocks in use (ref > 0) at once, since start-up
        # told of each cached block allocation evicts, before it forgets the block's hash (the second KV tier)
        self.on_evict: Callable[[KVBlock], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._blank)

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold prefix-cached KV (reused on a hit, else evicted last)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def allocate(self, n: int) -> list[KVBlock]:
        """n fresh blocks (ref 1): blank ones first, then evicting the least recently freed cached ones."""
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks with only {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            if self._blank:
                _, block = self._blank.popitem(last=True)
            else:
                _, block = self._free.popitem(last=False)
                if self.on_evict is not None:
                    self.on_evict(block)
                self._uncache(block)
            block.ref_cnt = 1
            out.append(block)
        self._note_peak()
        return out

    def take(self, blocks: Iterable[KVBlock]) -> None:
        """Share already-filled blocks (prefix hits or forks): ref + 1, out of the free LRU."""
        for block in blocks:
            if block.ref_cnt == 0:
                self._pool_of(block).pop(block.block_id)
            block.ref_cnt += 1
        self._note_peak()

    def release(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block; blocks reaching 0 join the LRU's tail in the
        order given (so pass a request's blocks tail first: its prefix is evicted last)."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._pool_of(block)[block.block_id] = block

    def lookup(self, block_hash: int, token_ids: tuple[int, ...]) -> KVBlock | None:
        block = self._cached.get(block_hash)
        if block is None or block.token_ids != token_ids:  # hash collision: not a hit
            return None
        return block

    def cache(self, block: KVBlock, block_hash: int, token_ids: tuple[int, ...]) -> None:
        if block.block_hash is not None:
            return
        if block_hash in self._cached:
            return  # an identical block is already indexed; this one stays private
        if block.ref_cnt == 0:  # a free block changes pools: blank -> cached LRU (tail)
            del self._blank[block.block_id]
            self._free[block.block_id] = block
        block.block_hash = block_hash
        block.token_ids = token_ids
        self._cached[block_hash] = block

    def count_in_free(self, blocks: Iterable[KVBlock]) -> int:
        return sum(1 for b in blocks if b.ref_cnt == 0)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; only possible when no block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        while self._free:  # oldest first, so the most recently used block ends on top of the stack
            _, block = self._free.popitem(last=False)
            self._uncache(block)
            self._blank[block.block_id] = block
        return True

    def _note_peak(self) -> None:
        self.peak_used_blocks = max(self.peak_used_blocks, self.num_blocks - self.num_free_blocks)

    def _pool_of(self, block: KVBlock) -> OrderedDict[int, KVBlock]:
        return self._free if block.block_hash is not None else self._blank

    def _uncache(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
            block.block_hash = None
            block.token_ids = None
