"""Prompt lookup (reference-based decoding): match the last n tokens of a request (n from
prompt_lookup_max down to prompt_lookup_min) earlier in its prompt and output, and propose the k
tokens that followed the latest match. A request's reference text (OpenAI's Predicted Outputs) is
searched first, where it has one."""

from __future__ import annotations

from collections.abc import Sequence

from tokenmill.spec_decode.proposer import ProposalInput


def lookup(tokens: Sequence[int], k: int, n_min: int, n_max: int, reference: Sequence[int] | None = None
           ) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of tokens' last n (longest n first),
    in `reference` where given (a match there may be anywhere), else in tokens themselves."""
    size = len(tokens)
    for n in range(min(n_max, size), n_min - 1, -1):
        tail = list(tokens[size - n:])
        if reference is not None:
            hit = _last_match(reference, tail, len(reference) - n)
            if hit >= 0:
                return list(reference[hit + n:hit + n + k])
            continue
        hit = _last_match(tokens, tail, size - n - 1)  # not the tail itself
        if hit >= 0:
            return list(tokens[hit + n:hit + n + k])
    return []


def _last_match(seq: Sequence[int], pattern: list[int], last_start: int) -> int:
    """The largest start <= last_start where seq holds pattern, -1 if none."""
    n, first = len(pattern), pattern[0]
    for start in range(last_start, -1, -1):
        if seq[start] == first and list(seq[start:start + n]) == pattern:
            return start
    return -1


class NgramProposer:
    def __init__(self, k: int, n_min: int = 1, n_max: int = 3) -> None:
        self.k, self.n_min, self.n_max = k, n_min, n_max

    def propose(self, batch: ProposalInput) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for i, (rid, tokens) in enumerate(zip(batch.req_ids, batch.token_ids, strict=True)):
            k = self.k if batch.max_drafts is None else batch.max_drafts[i]
            if k > 0 and (drafts := lookup(tokens, k, self.n_min, self.n_max)):
                out[rid] = drafts
        return out
