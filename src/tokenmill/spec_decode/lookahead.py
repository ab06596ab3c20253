"""Lookahead decoding: Jacobi iteration with an n-gram pool, no draft model.

Each request keeps a window of guessed future tokens. Verifying a window is one Jacobi iteration: the
target's token at each of its rows (ProposalInput.target_token_ids) is the next iterate of the guess
at that place, so the rows past the accepted run become the next window. Every n-gram that the
request's tokens and its windows' iterates form goes into the request's pool (key: n - 1 tokens, then
the continuation); a step proposes the pool's latest continuation of the request's last n - 1 tokens,
followed through the pool for up to k tokens, and the Jacobi window where the pool has none."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from tokenmill.spec_decode.proposer import ProposalInput


@dataclass
class _Lookahead:
    pool: dict[tuple[int, ...], deque[int]] = field(default_factory=dict)
    window: list[int] = field(default_factory=list)
    indexed: int = 0  # tokens whose n-grams are in the pool
    drafts: list[int] = field(default_factory=list)  # last proposed


class LookaheadProposer:
    def __init__(self, k: int, ngram: int = 4, pool_size: int = 64) -> None:
        self.k, self.key_len, self.pool_size = k, ngram - 1, pool_size
        self.states: dict[str, _Lookahead] = {}

    def finished(self, req_ids: set[str]) -> None:
        for rid in req_ids:
            self.states.pop(rid, None)

    def propose(self, batch: ProposalInput) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for i, (rid, tokens) in enumerate(zip(batch.req_ids, batch.token_ids, strict=True)):
            st = self.states.setdefault(rid, _Lookahead())
            taken = batch.num_new_tokens[i]
            rows = batch.target_token_ids[i] if batch.target_token_ids is not None else []
            # the Jacobi iterate past the accepted run (the rows after the one that gave the newest token)
            st.window = list(rows[taken:]) if len(rows) > taken else st.window[taken:]
            self._index(st, tokens)
            if st.window:
                self._add(st, tuple(tokens[len(tokens) - self.key_len:]), st.window[0])
            k = self.k if batch.max_drafts is None else batch.max_drafts[i]
            drafts = self._from_pool(st, tokens, k) if k > 0 else []
            if k > 0 and not drafts:
                drafts = (st.window or list(tokens[-k:]))[:k]  # a fresh window: the request's own tokens
            st.drafts = drafts
            if drafts:
                out[rid] = drafts
        return out

    def _index(self, st: _Lookahead, tokens: list[int]) -> None:
        n = self.key_len
        for end in range(max(st.indexed, n), len(tokens)):
            self._add(st, tuple(tokens[end - n:end]), tokens[end])
        st.indexed = len(tokens)

    def _add(self, st: _Lookahead, key: tuple[int, ...], nxt: int) -> None:
        if len(key) < self.key_len:
            return
        conts = st.pool.setdefault(key, deque(maxlen=self.pool_size))
        if nxt in conts:
            conts.remove(nxt)
        conts.append(nxt)  # latest last

    def _from_pool(self, st: _Lookahead, tokens: list[int], k: int) -> list[int]:
        seq = list(tokens[len(tokens) - self.key_len:])
        drafts: list[int] = []
        while len(drafts) < k:
            conts = st.pool.get(tuple(seq[len(seq) - self.key_len:]))
            if not conts:
                break
            drafts.append(conts[-1])
            seq.append(conts[-1])
        return drafts
