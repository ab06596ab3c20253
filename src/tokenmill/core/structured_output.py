"""The seam for structured output (grammars, JSON schemas, choice lists): for each request that samples
in a step, a token bitmask per sampled position, and afterwards the tokens the request took.

The bitmask layout is xgrammar's: int32 words, ceil(vocab / 32) per position, token t allowed where bit
t % 32 of word t // 32 is set (structured/bitmask.py packs and unpacks them). A grammar backend
(xgrammar, llguidance) implements StructuredOutput; the scheduler asks it while building each step
and passes the masks to the workers in the SchedulerOutput as numpy arrays, which core/ only hands on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

from tokenmill.core.request import Request

if TYPE_CHECKING:
    import numpy as np

BITS_PER_WORD = 32


def bitmask_words(vocab_size: int) -> int:
    return -(-vocab_size // BITS_PER_WORD)


class StructuredOutput(Protocol):
    def is_ready(self, request: Request) -> bool:
        """Whether the request may be scheduled: it has no grammar or its grammar is ready (a backend
        compiles off the step loop; the scheduler schedules other requests meanwhile). A ValueError: the
        grammar cannot be built, and the request ends with that error."""
        ...

    def grammar_bitmask(self, requests: Sequence[Request],
                        drafts: Mapping[str, list[int]]) -> dict[str, np.ndarray]:
        """For the requests that sample this step: int32 [1 + k, words] for each one constrained (the
        others are left out), row j for the position after the request's tokens and its first j
        drafts (drafts[request_id], k of them; none for most) as if they were accepted. Rows past a
        draft the grammar rejects may hold anything: verification stops at that draft."""
        ...

    def accept_tokens(self, request: Request, token_ids: list[int]) -> bool:
        """The tokens the request took this step (accepted drafts and one more), cut where it stopped.
        True: its grammar has reached an end state nothing but a stop token may follow, and the request
        ends ("stop")."""
        ...

    def free(self, request_id: str) -> None:
        """The request finished (or was aborted): drop what is kept for it."""
        ...


class NoStructuredOutput:
    """The default: no request is constrained."""

    def is_ready(self, request: Request) -> bool:
        return True

    def grammar_bitmask(self, requests: Sequence[Request],
                        drafts: Mapping[str, list[int]]) -> dict[str, np.ndarray]:
        return {}

    def accept_tokens(self, request: Request, token_ids: list[int]) -> bool:
        return False

    def free(self, request_id: str) -> None:
        pass
