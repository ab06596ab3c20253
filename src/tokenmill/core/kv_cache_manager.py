"""Per-request block tables over the block pool, with automatic prefix caching."""

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
        hits taken now). Returns the ids of the blocks added, or None if the pool is short."""
        computed_blocks = computed_blocks or []
        blocks = self.req_blocks.setdefault(request.request_id, [])
        num_tokens = request.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        need = -(-num_tokens // self.block_size) - len(blocks) - len(computed_blocks)
        if need <= 0 and not computed_blocks:  # most decode steps: the last block has room
            return []
        available = self.pool.num_free_blocks - self.pool.count_in_free(computed_blocks)
        if need > available:
            if not blocks:
                del self.req_blocks[request.request_id]
            return None
        self.pool.take(computed_blocks)
        new_blocks = self.pool.allocate(max(need, 0))
        blocks.extend(computed_blocks)
        blocks.extend(new_blocks)
        if computed_blocks:
            self._num_cached[request.request_id] = len(blocks) - len(new_blocks)
        return [b.block_id for b in computed_blocks + new_blocks]

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
        """Give child the parent's blocks covering its first num_tokens (shared, ref-counted);
        a partial last block is copied by the caller into a fresh block."""
        parent = self.req_blocks[parent_id]
        n_full = num_tokens // self.block_size
        shared = parent[:n_full]
        # allocate before sharing: if the pool is short, raise with no reference taken
        partial = self.pool.allocate(1) if num_tokens % self.block_size else []
        self.pool.take(shared)
        child = self.req_blocks[child_id] = shared + partial
        self._num_cached[child_id] = 0
        return [b.block_id for b in child]

    def free(self, request_id: str) -> None:
        blocks = self.req_blocks.pop(request_id, None)
        self._num_cached.pop(request_id, None)
        if blocks:
            self.pool.release(reversed(blocks))

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
