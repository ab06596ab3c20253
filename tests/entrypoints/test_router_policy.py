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
    assert table.held(A) == 1 and table.held(B) == 3  # old's second chunk is left
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
    assert other is not None and other is not first  # a new prefix goes to the replica holding fewer chunks
    assert pool.prefix_routed == 5


def test_new_prefixes_spread_over_the_caches_not_over_whoever_is_idle() -> None:
    """A replica that holds more prefix chunks gets no new prefix while the other holds fewer, even
    when it is the idle one at that moment (within the bound on imbalance); the table counts what
    each replica holds, and forgets it with the replica."""
    pool = _pool(balance_abs=2, balance_rel=1.5)
    a, b = pool.replicas[A], pool.replicas[B]
    prefixes = [prefix_hashes(c * 4 * TEXT_CHUNK_CHARS, 100) for c in "pqrstu"]
    for h in prefixes:
        r = pool.choose(h)
        assert r is not None
        pool.started(r, h)
        pool.finished(r)
        other = b if r is a else a
        other.in_flight, r.in_flight = 1, 0  # the replica just chosen is idle, the other is busy
    assert pool.affinity.held(A) == pool.affinity.held(B) == 12  # three 4-chunk prefixes each
    a.in_flight, b.in_flight = 4, 0  # past the bound: a new prefix goes to the least loaded
    assert pool.choose(prefix_hashes("v" * 4 * TEXT_CHUNK_CHARS, 100)) is b
    pool.affinity.forget(A)
    assert pool.affinity.held(A) == 0 and pool.affinity.held(B) == 12


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


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"messages": 5}),
    ("/v1/chat/completions", {"messages": "hi"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}),
    ("/v1/completions", {"prompt": [2**64] * 40}),
    ("/v1/completions", {"prompt": [[-(2**63) - 1]]}),
    ("/v1/completions", {"prompt": {"a": 1}}),
    ("/v1/responses", {"input": [None, 1]}),
])
def test_any_body_gets_a_routing_key(path: str, body: dict[str, object]) -> None:
    """Whatever JSON object a client sends, the router hashes something (the replica answers the 400)."""
    assert isinstance(prefix_hashes(routing_key(path, body), 100), list)
