"""The contract between the scheduler and the workers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenmill.core.messages import LogprobEntry
from tokenmill.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenmill.core.structured_output import GrammarBitmasks


@dataclass
class NewRequestData:
    """A request the workers have not seen: everything they need to hold its state."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    # tokens it has taken already: a disaggregated consumer's request starts with the producer's first token
    output_token_ids: list[int] = field(default_factory=list)


@dataclass
class CachedRequestData:
    """A request the workers hold: what changed since the last step."""

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    # then new_block_ids is the whole new block table (also when a block was replaced by its copy)
    resumed_from_preemption: bool = False


@dataclass
class OffloadBlock:
    """A first-tier block whose KV the workers read out (before the step writes anything) and return in
    `ModelRunnerOutput.offloaded_kv`, for the second tier (core/kv_offload.py): a prefix block the pool
    evicts, keyed by its chained hash and tokens, or a block of a request preempted by swapping; or, for
    KV transfer, a block a producer sends."""

    block_id: int
    block_hash: int | None = None  # a prefix block's
    token_ids: tuple[int, ...] = ()
    request_id: str | None = None  # a swapped request's
    # a block a KV producer sends to a consumer (core/kv_transfer.py): the transfer and the block's index
    # in the request's table; the second tier passes these over
    transfer_id: str | None = None
    index: int = 0


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str] = field(default_factory=set)
    # draft tokens scheduled as extra inputs after a request's last token (counted in
    # num_scheduled_tokens): the step verifies them and samples one more
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # the constrained requests that sample this step: int32 [1 + drafts, words] token bitmasks
    # (core/structured_output.py has the layout), or a Future of them (filled off the step loop)
    grammar_bitmask: GrammarBitmasks = field(default_factory=dict)
    # copy-on-write: (source, destination) block ids whose KV (every layer's, scales included) the
    # workers copy, in order, before the step's tokens are written
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    # whether the workers may propose drafts after this step: False for a step scheduled while another
    # runs (async scheduling), whose drafts would not follow the tokens the step in flight takes
    propose_drafts: bool = True
    # the second KV tier: blocks read out first (their bytes come back in ModelRunnerOutput.offloaded_kv, in
    # order), then the copies above, then (block id, bytes) written into blocks, before the step's tokens
    blocks_to_offload: list[OffloadBlock] = field(default_factory=list)
    blocks_to_load: list[tuple[int, bytes]] = field(default_factory=list)
    # KV transfer: the requests whose pulled blocks are among blocks_to_load (scheduler-side bookkeeping)
    kv_transfer_reqs: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0

    @property
    def moves_kv(self) -> bool:
        """Whether the workers have blocks to read out or write in, even with no token to compute."""
        return bool(self.blocks_to_offload or self.blocks_to_load)


@dataclass
class ModelRunnerOutput:
    """Per scheduled request (in `req_ids` order): the tokens it took this step, empty for a prefill
    chunk that does not reach the end of the known tokens, else its accepted drafts and one more."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    # per request: one entry per sampled token
    logprobs: dict[str, list[LogprobEntry]] = field(default_factory=dict)
    # per request: (first position, one entry per position from there)
    prompt_logprobs: dict[str, tuple[int, list[LogprobEntry]]] = field(default_factory=dict)
    # per request: draft tokens proposed to follow the ones it took, for the next step to verify
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # per request whose preparation or sampling failed this step: the error (the request ends with it)
    failed: dict[str, str] = field(default_factory=dict)
    # the KV bytes of SchedulerOutput.blocks_to_offload, in its order
    offloaded_kv: list[bytes] = field(default_factory=list)
    # the proposer's cost gate chose steps without drafts at this batch size (spec_decode/adaptive.py): how many of
    # the next steps the engine may overlap (they propose nothing) before it lets the proposer probe again
    spec_gated: int = 0
