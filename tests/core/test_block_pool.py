"""BlockPool: reference counts, the LRU of free blocks, the prefix-cache index."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tokenmill.core.block_pool import BlockPool, KVBlock


def _ids(blocks: list[KVBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def test_allocate_hands_out_distinct_blocks_with_ref_one() -> None:
    pool = BlockPool(8)
    blocks = pool.allocate(5)
    assert len(set(_ids(blocks))) == 5
    assert all(b.ref_cnt == 1 for b in blocks)
    assert pool.num_free_blocks == 3
    pool.release(blocks)
    assert pool.num_free_blocks == 8 and all(b.ref_cnt == 0 for b in pool.blocks)


def test_allocate_more_than_free_raises_and_changes_nothing() -> None:
    pool = BlockPool(4)
    held = pool.allocate(3)
    with pytest.raises(ValueError, match="2 blocks with only 1 free"):
        pool.allocate(2)
    assert pool.num_free_blocks == 1
    assert [b.ref_cnt for b in pool.blocks] == [1, 1, 1, 0]
    pool.release(held)


def test_double_free_raises() -> None:
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.release([block])
    with pytest.raises(RuntimeError, match="double free"):
        pool.release([block])
    assert pool.num_free_blocks == 2


def test_pool_needs_a_block() -> None:
    with pytest.raises(ValueError, match="at least one block"):
        BlockPool(0)


def test_lru_evicts_least_recently_freed_first() -> None:
    pool = BlockPool(4)
    a, b, c, d = pool.allocate(4)
    for i, block in enumerate((a, b, c, d)):
        pool.cache(block, 100 + i, (i,))
    # freed in the order c, a, d, b: eviction must follow that order
    for block in (c, a, d, b):
        pool.release([block])
    assert pool.num_cached_blocks == 4
    assert _ids(pool.allocate(1)) == [c.block_id]
    assert pool.lookup(102, (2,)) is None  # evicted: no longer a hit
    assert pool.lookup(100, (0,)) is a  # still cached
    assert _ids(pool.allocate(2)) == [a.block_id, d.block_id]
    assert pool.lookup(100, (0,)) is None and pool.lookup(101, (1,)) is b
    assert pool.num_cached_blocks == 1


def test_never_used_blocks_go_before_cached_ones() -> None:
    pool = BlockPool(4)
    (cached,) = pool.allocate(1)
    pool.cache(cached, 7, (1, 2))
    pool.release([cached])
    fresh = pool.allocate(3)
    assert cached.block_id not in _ids(fresh)
    assert pool.lookup(7, (1, 2)) is cached


def test_a_hit_refreshes_a_block_in_the_lru() -> None:
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.cache(a, 1, (1,))
    pool.cache(b, 2, (2,))
    pool.release([a, b, c])  # LRU: a, b; c holds nothing cached (blank)
    hit = pool.lookup(1, (1,))
    assert hit is a
    pool.take([hit])  # a is in use again: out of the LRU
    assert a.ref_cnt == 1 and pool.num_free_blocks == 2
    pool.release([a])  # back at the tail: LRU b, a
    assert _ids(pool.allocate(2)) == [c.block_id, b.block_id]  # the blank one first, then the LRU
    assert pool.lookup(1, (1,)) is a


def test_release_tail_first_keeps_the_prefix_longest() -> None:
    pool = BlockPool(3)
    table = pool.allocate(3)
    for i, block in enumerate(table):
        pool.cache(block, 10 + i, (i,))
    pool.release(reversed(table))
    assert _ids(pool.allocate(1)) == [table[2].block_id]
    assert pool.lookup(10, (0,)) is table[0] and pool.lookup(11, (1,)) is table[1]


def test_lookup_compares_token_ids_on_hash_collision() -> None:
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache(a, 42, (1, 2, 3))
    assert pool.lookup(42, (1, 2, 3)) is a
    assert pool.lookup(42, (1, 2, 4)) is None
    assert pool.lookup(42, (1, 2)) is None
    # a colliding block is not indexed over the first one, and stays private
    pool.cache(b, 42, (9, 9, 9))
    assert b.block_hash is None and b.token_ids is None
    assert pool.lookup(42, (9, 9, 9)) is None
    assert pool.lookup(42, (1, 2, 3)) is a
    pool.release([a, b])


def test_take_shares_a_free_cached_block() -> None:
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.cache(a, 5, (5,))
    pool.release([a])
    assert pool.count_in_free([a]) == 1
    pool.take([a])
    pool.take([a])
    assert a.ref_cnt == 2 and pool.num_free_blocks == 1 and pool.count_in_free([a]) == 0
    pool.release([a])
    assert pool.num_free_blocks == 1
    pool.release([a])
    assert pool.num_free_blocks == 2


def test_reset_prefix_cache_only_when_idle() -> None:
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache(a, 1, (1,))
    pool.release([b])
    assert not pool.reset_prefix_cache()
    assert pool.lookup(1, (1,)) is a
    pool.release([a])
    assert pool.reset_prefix_cache()
    assert pool.lookup(1, (1,)) is None and pool.num_cached_blocks == 0
    assert a.block_hash is None


class PoolMachine(RuleBasedStateMachine):
    """Owners allocate, share (take) and release blocks; the pool's books must always match
    what the owners hold."""

    NUM_BLOCKS = 6

    @initialize()
    def start(self) -> None:
        self.pool = BlockPool(self.NUM_BLOCKS)
        self.owners: list[list[KVBlock]] = []
        self.next_hash = 0
        self.most_held = 0  # the most distinct blocks the owners have held at once

    @rule(n=st.integers(0, NUM_BLOCKS + 1))
    def allocate(self, n: int) -> None:
        free_before = self.pool.num_free_blocks
        if n > free_before:
            with pytest.raises(ValueError):
                self.pool.allocate(n)
            assert self.pool.num_free_blocks == free_before
            return
        blocks = self.pool.allocate(n)
        assert all(b.block_hash is None for b in blocks)
        self.owners.append(blocks)

    @precondition(lambda self: self.owners)
    @rule(data=st.data())
    def cache_one(self, data: st.DataObject) -> None:
        owner = data.draw(st.sampled_from(self.owners))
        if owner:
            block = data.draw(st.sampled_from(owner))
            self.next_hash += 1
            self.pool.cache(block, self.next_hash, (self.next_hash,))

    @precondition(lambda self: self.pool.num_cached_blocks > 0)
    @rule(data=st.data())
    def share_cached(self, data: st.DataObject) -> None:
        block_hash = data.draw(st.sampled_from(sorted(self.pool._cached)))
        hit = self.pool.lookup(block_hash, (block_hash,))
        assert hit is not None and hit.block_hash == block_hash
        self.pool.take([hit])
        self.owners.append([hit])

    @precondition(lambda self: self.owners)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        owner = self.owners.pop(data.draw(st.integers(0, len(self.owners) - 1)))
        self.pool.release(reversed(owner))

    @invariant()
    def books_balance(self) -> None:
        held: dict[int, int] = {}
        for owner in self.owners:
            for b in owner:
                held[b.block_id] = held.get(b.block_id, 0) + 1
        for b in self.pool.blocks:
            assert b.ref_cnt == held.get(b.block_id, 0), b
            assert (b.block_id in self.pool._free or b.block_id in self.pool._blank) == (b.ref_cnt == 0)
            assert b.block_id not in self.pool._free or b.block_hash is not None
            assert b.block_id not in self.pool._blank or b.block_hash is None
        assert self.pool.num_free_blocks == self.NUM_BLOCKS - len(held)
        self.most_held = max(self.most_held, len(held))
        assert self.pool.peak_used_blocks == self.most_held
        for block_hash, b in self.pool._cached.items():
            assert b.block_hash == block_hash and b.token_ids == (block_hash,)

    def teardown(self) -> None:
        for owner in self.owners:
            self.pool.release(owner)
        assert self.pool.num_free_blocks == self.NUM_BLOCKS
        assert all(b.ref_cnt == 0 for b in self.pool.blocks)


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=100, stateful_step_count=25, deadline=None)


def test_blank_blocks_are_reused_most_recently_freed_first() -> None:
    # memory written before is handed out again before blocks never written (fresh pages fault)
    pool = BlockPool(8)
    a = pool.allocate(3)
    assert [b.block_id for b in a] == [0, 1, 2]
    pool.release(a)  # no cached content: blank, back on the stack
    assert [b.block_id for b in pool.allocate(2)] == [2, 1]


def test_reset_prefix_cache_reuses_the_last_written_blocks_first() -> None:
    pool = BlockPool(8)
    a = pool.allocate(4)
    for i, b in enumerate(a):
        pool.cache(b, 100 + i, (100 + i,))
    pool.release(a)
    assert pool.reset_prefix_cache() and pool.num_cached_blocks == 0
    assert sorted(b.block_id for b in pool.allocate(4)) == [0, 1, 2, 3]
