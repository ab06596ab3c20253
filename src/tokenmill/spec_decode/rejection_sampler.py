"""Verifying draft tokens against the target model.

A request with drafts d_0 .. d_{k-1} runs its last token and the drafts through the model in one
step, which gives the target distribution p_j at each of the 1 + k positions (p_j as if the drafts
before j were taken), each under the request's own sampling: bitmask, penalties, temperature, filters.

Greedy: the drafts are taken while each is its position's argmax, then that position's argmax (after
the last draft, the bonus token).

Random: the proposers give tokens, not distributions, so each proposal is a point mass q_j = 1 at d_j.
Speculative sampling's rule then accepts d_j with probability min(1, p_j(d_j) / q_j(d_j)) = p_j(d_j),
and on a rejection samples from the residual max(0, p_j - q_j) normalised, which is p_j with d_j
removed and renormalised. One draw does both: sample x_j from p_j as without drafts and accept d_j
exactly when x_j == d_j, since P(x_j = d_j) = p_j(d_j) and, given x_j != d_j, x_j follows p_j
without d_j, renormalised. So greedy and random take the same rule over the sampler's tokens, a
seeded request draws one uniform per token taken, and it draws the same uniforms as with no drafts.
"""

from __future__ import annotations

from collections.abc import Sequence


def accepted_run(target: Sequence[int], drafts: Sequence[int]) -> list[int]:
    """The tokens a request takes, from target[j], the token sampled at position j (1 + len(drafts)
    of them): each draft while it is its position's token, then the first position's token that
    is not its draft, or the token after the last draft."""
    for j, draft in enumerate(drafts):
        if target[j] != draft:
            return list(target[:j + 1])
    return list(target[:len(drafts) + 1])
