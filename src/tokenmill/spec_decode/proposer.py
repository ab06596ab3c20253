"""The proposer seam: after each step's sampling the model runner asks its proposer (None by default)
for draft tokens to follow each request's tokens; they come back to the scheduler in
ModelRunnerOutput.spec_token_ids and are verified the step after (rejection_sampler.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass
class ProposalInput:
    """The requests that took tokens this step, in batch order."""

    req_ids: list[str]
    token_ids: list[list[int]]  # each one's prompt and output tokens, this step's included (read only)
    num_new_tokens: list[int]  # how many each took this step (accepted drafts and one more)


class Proposer(Protocol):
    def propose(self, batch: ProposalInput) -> dict[str, list[int]]:
        """Draft tokens to follow each request's tokens (a request left out gets none). The scheduler
        cuts them to what the request can still take and the step's token budget allows."""
        ...
