"""The router's routing decisions, without any server: prefix hashes, the affinity table, the policies."""

from __future__ import annotations

import pytest

from tokenmill.entrypoints.router.affinity import TEXT_CHUNK_CHARS, TOKEN_CHUNK, PrefixAffinity, prefix_hashes
from tokenmill.entrypoints.router.app import routing_key
from tokenmill.entrypoints.router.pool import ReplicaPool

A, B = "http://127.0.0.1:1", "http://127.0.0.1:2"


def test_prefix_hashes_chain_whole_chunks_only() -> None:
    text = "x" * (3 * TEXT_CHUNK_CHARS + 5)
    hashes = prefix_hashes(text, max_chunks=100)
    assert len(hashes) == 3  # the trailing partial chunk is not hashed
    assert prefix_hashes(text[: 2 * TEXT_CHUNK_CHARS], 100) == hashes[:2]
    # a chain: the same second chunk after another first chunk hashes differently
    other = "y" * TEXT_CHUNK_CHARS + "x" * TEXT_CHUNK_CHARS
    assert prefix_hashes(other, 100)[1] != hashes[1]
    assert len(prefix_hashes(text, max_chunks=2)) == 2
    tokens = list(range(2 * TOKEN_CHUNK + 3))
    assert len(prefix_hashes(tokens, 100)) == 2
    assert prefix_hashes(tokens, 100) != prefix_hashes([t + 1 for t in tokens], 100)


def test_affinity_matches_runs_from_the_first_chunk() -> None:
    table = PrefixAffinity()
    h = prefix_hashes("a" * 4 * TEXT_CHUNK_CHARS, 100)
    table.record(h[:3], A)
    table.record(h[:1], B)
    assert table.matches(h) == {A: 3, B: 1}
    assert table.matches(prefix_hashes("b" * 4 * TEXT_CHUNK_CHARS, 100)) == {}
    table.forget(A)
    assert table.matches(h) == {B: 1}


def test_affinity_is_bounded_least_recently_used_first() -> None:
    table = PrefixAffinity(capacity=4)
    old = prefix_hashes("o" * 2 * TEXT_CHUNK_CHARS, 100)
    new = prefix_hashes("n" * 3 * TEXT_CHUNK_CHARS, 100)
    table.record(old, A)
    table.record(new, B)
    assert len(table) == 4
    assert table.matches(old) == {}  # its first chunk went out first, so the whole run is gone
    assert table.matches(new) == {B: 3}
    with pytest.raises(ValueError, match="capacity"):
        PrefixAffinity(capacity=0)


def _pool(policy: str = "prefix", **kw: float) -> ReplicaPool:
    pool = ReplicaPool(policy, **kw)  # type: ignore[arg-type]
    for url in (A, B):
        pool.mark_ok(pool.add(url))
    return pool


def test_prefix_policy_sends_a_shared_prefix_to_its_replica() -> None:
    pool = _pool()
    h = prefix_hashes("s" * 5 * TEXT_CHUNK_CHARS, 100)
    first = pool.choose(h)
    assert first is not None
    pool.started(first, h)
    for _ in range(5):  # the holder keeps it while the imbalance stays within the bound
        r = pool.choose(h)
        assert r is first
        pool.started(r, h)
    other = pool.choose(prefix_hashes("t" * 5 * TEXT_CHUNK_CHARS, 100))
    assert other is not None and other is not first  # a new prefix goes to the least loaded
    assert pool.prefix_routed == 5


def test_prefix_policy_leaves_an_overloaded_holder() -> None:
    pool = _pool(balance_abs=2, balance_rel=1.5)
    h = prefix_hashes("s" * 2 * TEXT_CHUNK_CHARS, 100)
    holder = pool.replicas[A]
    pool.started(holder, h)
    holder.in_flight = 3  # 3 > 0 + 2 and 3 > 0 * 1.5
    assert pool.choose(h) is pool.replicas[B]
    holder.in_flight = 2
    assert pool.choose(h) is holder


def test_least_load_round_robin_and_health() -> None:
    pool = _pool("least_load")
    pool.replicas[A].in_flight = 2
    assert pool.choose([]) is pool.replicas[B]
    pool.mark_dead(pool.replicas[B])
    assert pool.choose([]) is pool.replicas[A]
    assert pool.choose([], exclude={A}) is None
    rr = _pool("round_robin")
    assert [rr.choose([]).url for _ in range(4)] == [A, B, A, B]  # type: ignore[union-attr]


def test_failed_probes_take_a_replica_out_after_max_failures() -> None:
    pool = _pool(max_failures=2)
    pool.mark_failed(pool.replicas[A])
    assert pool.replicas[A].healthy
    pool.mark_failed(pool.replicas[A])
    assert not pool.replicas[A].healthy
    pool.mark_ok(pool.replicas[A])
    assert pool.replicas[A].healthy and pool.replicas[A].failures == 0


@pytest.mark.parametrize("kwargs, message", [
    ({"policy": "random"}, "unknown routing policy"),
    ({"balance_rel": 0.5}, "--balance-rel"),
    ({"max_failures": 0}, "--max-failures"),
])
def test_bad_configuration_is_one_clear_error(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ReplicaPool(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="http://"):
        ReplicaPool().add("127.0.0.1:8000")


def test_routing_key_of_each_endpoint() -> None:
    assert routing_key("/v1/completions", {"prompt": "abc"}) == "abc"
    assert routing_key("/v1/completions", {"prompt": [[1, 2, 3], [4]]}) == [1, 2, 3]
    assert routing_key("/v1/completions", {"prompt": ["p", "q"]}) == "p"
    chat = {"messages": [{"role": "system", "content": "S"},
                         {"role": "user", "content": [{"type": "text", "text": "U"}]}]}
    assert routing_key("/v1/chat/completions", chat) == "<system>S<user>U"
    assert routing_key("/v1/embeddings", {"input": "e"}) == "e"
    assert routing_key("/v1/completions", {"prompt": 5}) == ""
