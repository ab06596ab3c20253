"""The seam for structured output (grammars, JSON schemas, choice lists): for each request that samples
in a step, a token bitmask per sampled position, and afterwards the tokens the request took.

The bitmask layout is xgrammar's: int32 words, ceil(vocab / 32) per position, token t allowed where bit
t % 32 of word t // 32 is set (structured/bitmask.py packs and unpacks them). A grammar backend
(xgrammar, llguidance) implements StructuredOutput; the scheduler asks it while building each step
and passes the masks to the workers in the SchedulerOutput as numpy arrays, which core/ only hands on.

A backend may fill a step's bitmasks off the step loop: it returns a Future of them, which the worker
waits for only when it samples (after the model's forward). One that sets `follows_tokens_in_flight`
fills a request's rows only once it was told (accept_tokens) every token before them, so with async
scheduling a constrained request is scheduled while the step that samples its last token still runs;
for a backend that does not, such a request waits for that step (the scheduler's _waits_for_tokens).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Protocol, Union

from tokenmill.core.request import Request

if TYPE_CHECKING:
    import numpy as np

BITS_PER_WORD = 32


def bitmask_words(vocab_size: int) -> int:
    return -(-vocab_size // BITS_PER_WORD)


# request id -> int32 [1 + drafts, words], now or once filled
GrammarBitmasks = Union["dict[str, np.ndarray]", "Future[dict[str, np.ndarray]]"]


class StructuredOutput(Protocol):
    follows_tokens_in_flight: bool

    def is_ready(self, request: Request) -> bool:
        """Whether the request may be scheduled: it has no grammar or its grammar is ready (a backend
        compiles off the step loop; the scheduler schedules other requests meanwhile). A ValueError: the
        grammar cannot be built, and the request ends with that error."""
        ...

    def grammar_bitmask(self, requests: Sequence[Request],
                        drafts: Mapping[str, list[int]]) -> GrammarBitmasks:
        """For the requests that sample this step: int32 [1 + k, words] for each one constrained (the
        others are left out), row j for the position after the request's tokens and its first j
        drafts (drafts[request_id], k of them; none for most) as if they were accepted. Rows past a
        draft the grammar rejects may hold anything: verification stops at that draft. An empty dict
        where none is constrained."""
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

    follows_tokens_in_flight = False

    def is_ready(self, request: Request) -> bool:
        return True

    def grammar_bitmask(self, requests: Sequence[Request],
                        drafts: Mapping[str, list[int]]) -> GrammarBitmasks:
        return {}

    def accept_tokens(self, request: Request, token_ids: list[int]) -> bool:
        return False

    def free(self, request_id: str) -> None:
        pass
