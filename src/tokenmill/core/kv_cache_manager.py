"""Per-request block tables over the block pool, with automatic prefix caching and copy-on-write.

A fork gives a child every block of its parent by reference (a partial last block too). A shared
or prefix-cached block is read-only: before a request writes into a block that another table also
holds or that the prefix cache indexes (only a request's partial last block can be written),
`allocate_slots` gives the writer a fresh block and queues the (source, destination) pair in
`pending_copies`, for the workers to copy the KV rows before the step that writes runs (vLLM v0's
`copy_on_write` and `blocks_to_copy`)."""

from __future__ import annotations

from tokenmill.core.block_pool import BlockPool, KVBlock
from tokenmill.core.prefix_cache import extend_block_hashes
from tokenmill.core.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self._num_cached: dict[str, int] = {}  # leading blocks of a request already indexed
        self.prefix_queries = 0  # tokens looked up
        self.prefix_hits = 0  # tokens found
        self.copied_on_write = False  # whether the last allocate_slots replaced a shared block by a copy
        self.pending_copies: list[tuple[int, int]] = []  # copy-on-write (source, destination) block ids, in order

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def get_computed_blocks(self, request: Request) -> list[KVBlock]:
        """The longest run of cached blocks that prefixes the request's tokens. At least one
        token is always left to compute, so the last prompt position yields logits."""
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return []
        tokens = request.all_token_ids
        extend_block_hashes(request.block_hashes, tokens, self.block_size, len(tokens))
        max_blocks = (len(tokens) - 1) // self.block_size
        hits: list[KVBlock] = []
        for i, block_hash in enumerate(request.block_hashes[:max_blocks]):
            start = i * self.block_size
            block = self.pool.lookup(block_hash, tuple(tokens[start:start + self.block_size]))
            if block is None:
                break
            hits.append(block)
        return hits

    def record_prefix_lookup(self, request: Request, num_hit_blocks: int) -> None:
        """Count a lookup once, when its request is admitted, not on every retry while it waits."""
        if self.enable_caching and request.sampling_params.prompt_logprobs is None:
            self.prefix_queries += request.num_tokens
            self.prefix_hits += num_hit_blocks * self.block_size

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: list[KVBlock] | None = None
    ) -> list[int] | None:
        """Make room for num_new_tokens after the computed ones (plus computed_blocks, prefix
        hits taken now). Returns the ids of the blocks added, or None if the pool is short. When
        the first new token goes into a block that is shared, that block is replaced by a copy
        first (`copied_on_write` says whether the last call did; `pending_copies` has the pair)."""
        computed_blocks = computed_blocks or []
        blocks = self.req_blocks.setdefault(request.request_id, [])
        self.copied_on_write = False
        num_tokens = request.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        need = -(-num_tokens // self.block_size) - len(blocks) - len(computed_blocks)
        shared = None if computed_blocks else self._shared_write_block(request, blocks, num_new_tokens)
        if need <= 0 and not computed_blocks and shared is None:  # most decode steps: the last block has room
            return []
        available = self.pool.num_free_blocks - self.pool.count_in_free(computed_blocks)
        if max(need, 0) + (shared is not None) > available:
            if not blocks:
                del self.req_blocks[request.request_id]
            return None
        if shared is not None:
            self._copy_on_write(blocks, shared)
        self.pool.take(computed_blocks)
        new_blocks = self.pool.allocate(max(need, 0))
        blocks.extend(computed_blocks)
        blocks.extend(new_blocks)
        if computed_blocks:
            self._num_cached[request.request_id] = len(blocks) - len(new_blocks)
        return [b.block_id for b in computed_blocks + new_blocks]

    def _shared_write_block(self, request: Request, blocks: list[KVBlock], num_new_tokens: int) -> int | None:
        """The index of the block the next token is written into, if it is already in the table (partly
        filled, for this request) and read-only: another table holds it too, or it is in the prefix
        cache (a child forked within a parent's full block)."""
        start = request.num_computed_tokens
        i = start // self.block_size
        if num_new_tokens <= 0 or start % self.block_size == 0 or i >= len(blocks):
            return None
        return i if blocks[i].ref_cnt > 1 or blocks[i].block_hash is not None else None

    def _copy_on_write(self, blocks: list[KVBlock], i: int) -> None:
        (copy,) = self.pool.allocate(1)
        source = blocks[i]
        blocks[i] = copy
        self.pool.release([source])  # still held by the others, or kept in the prefix cache
        self.pending_copies.append((source.block_id, copy.block_id))
        self.copied_on_write = True

    def take_copies(self) -> list[tuple[int, int]]:
        """The copies queued since the last call, for the step about to be sent to the workers."""
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def cache_full_blocks(self, request: Request) -> None:
        """Index the request's blocks whose tokens are all computed now."""
        if not self.enable_caching:
            return
        blocks = self.req_blocks.get(request.request_id)
        if not blocks:
            return
        start = self._num_cached.get(request.request_id, 0)
        # computed (or scheduled: a later step reads them only after the step that writes them) and
        # known: a token still being sampled has no id to hash yet
        num_tokens = min(request.num_computed_tokens, request.num_tokens)
        end = min(num_tokens // self.block_size, len(blocks))
        if end <= start:  # no block filled up since the last call (most decode steps); hashes can wait
            return
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size, num_tokens)
        tokens = request.all_token_ids
        for i in range(start, end):
            s = i * self.block_size
            self.pool.cache(blocks[i], request.block_hashes[i], tuple(tokens[s:s + self.block_size]))
        self._num_cached[request.request_id] = max(start, end)

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> list[int]:
        """Give child the parent's blocks covering its first num_tokens, all by reference (a partial
        last block too: whichever of them writes into it next gets a copy, see allocate_slots)."""
        if child_id in self.req_blocks:
            raise ValueError(f"request {child_id!r} already has blocks")
        shared = self.req_blocks[parent_id][:-(-num_tokens // self.block_size)]
        self.pool.take(shared)
        self.req_blocks[child_id] = list(shared)
        # the parent's full blocks are indexed already where they could be
        self._num_cached[child_id] = min(self._num_cached.get(parent_id, 0), num_tokens // self.block_size)
        return [b.block_id for b in shared]

    def free(self, request_id: str) -> None:
        blocks = self.req_blocks.pop(request_id, None)
        self._num_cached.pop(request_id, None)
        if blocks:
            self.pool.release(reversed(blocks))

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
