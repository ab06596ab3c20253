"""Typed messages between the engine front end and the engine core (in-process or over IPC)."""

from __future__ import annotations

import msgspec

from tokenmill.sampling_params import SamplingParams

# One position's logprobs, as the sampler makes them and the wire carries them: parallel lists
# (token ids, logprobs, ranks); index 0 is the sampled/actual token, the rest are the top-N in order.
LogprobEntry = tuple[list[int], list[float], list[int]]


class KVTransferParams(msgspec.Struct, array_like=True, omit_defaults=True):
    """A request's part in disaggregated prefill/decode (vLLM's `kv_transfer_params`): a producer computes
    the prompt and keeps its blocks (`do_remote_decode`); a consumer pulls them from the producer at
    remote_host:remote_port, where they are kept under remote_request_id (`do_remote_prefill`)."""

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_host: str = ""
    remote_port: int = 0
    remote_request_id: str = ""


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = 0.0
    priority: int = 0
    priority_class: int = 0  # core.request.PriorityClass
    group: str = ""  # the batch it belongs to (the scheduler takes turns between batches)
    # beam search (engine/beam_search.py): keep the KV blocks once finished, until aborted; start from
    # the blocks of kv_parent (a kept request whose tokens prefix this one's), shared copy-on-write
    hold_kv: bool = False
    kv_parent: str | None = None
    kv_transfer: KVTransferParams | None = None  # disaggregated prefill/decode (core/kv_transfer.py)


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[LogprobEntry] | None = None
    # prompt logprobs for positions [start, start + len): position p scores prompt token p
    prompt_logprobs: list[LogprobEntry] | None = None
    prompt_logprobs_start: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class StepStats(msgspec.Struct, omit_defaults=True):
    """The engine core's step counters (engine/step_meter.py), cumulative since start-up unless `last_`:
    the steps' wall time while busy, the prompt (prefill) and output (decode) tokens they computed,
    the bytes they read and FLOPs they did as tokenmill.model_math counts them, and the last step's
    batch composition. Absent when stats are disabled (--disable-log-stats)."""

    steps: int = 0
    busy_s: float = 0.0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    bytes: float = 0.0
    flops: float = 0.0
    last_prefill_tokens: int = 0
    last_decode_tokens: int = 0
    last_step_s: float = 0.0


class SchedulerStats(msgspec.Struct, omit_defaults=True):
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    prefix_cache_queries: int = 0  # tokens looked up, cumulative
    prefix_cache_hits: int = 0  # tokens found, cumulative
    num_preemptions: int = 0  # cumulative
    num_steps: int = 0  # steps that ran any token, cumulative
    peak_used_blocks: int = 0  # most KV blocks in use at once since start-up
    num_scheduled_tokens: int = 0  # tokens whose KV steps computed, cumulative
    num_blocks_copied: int = 0  # copy-on-write block copies, cumulative
    # speculative decoding, cumulative (vLLM's spec_decode counters): verifications of a request's
    # drafts, the drafts verified, those accepted, and those accepted at each draft position
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_num_accepted_tokens_per_pos: list[int] = msgspec.field(default_factory=list)
    num_cached_free_blocks: int = 0  # free blocks that still hold prefix-cached KV (counted in num_free_blocks)
    # the second KV tier, cumulative: prompt tokens whose KV was loaded from it instead of computed, by tier;
    # bytes moved out (evicted prefix blocks, swapped requests) and in; disk blocks that failed their checks;
    # requests swapped out and back in (--preemption-mode swap)
    kv_offload_memory_hits: int = 0
    kv_offload_disk_hits: int = 0
    kv_offload_bytes_offloaded: int = 0
    kv_offload_bytes_loaded: int = 0
    kv_offload_corrupt_blocks: int = 0
    num_swapped_out: int = 0
    num_swapped_in: int = 0
    # the second KV tier now (gauges; capacities 0 where that tier is off): prefix blocks held per tier,
    # blocks the memory tier reserves for swapped requests, and bytes held and allowed per tier
    kv_offload_memory_blocks: int = 0
    kv_offload_memory_swap_blocks: int = 0
    kv_offload_memory_used_bytes: int = 0
    kv_offload_memory_capacity_bytes: int = 0
    kv_offload_disk_blocks: int = 0
    kv_offload_disk_used_bytes: int = 0
    kv_offload_disk_capacity_bytes: int = 0
    # structured output, cumulative: constrained requests by kind (json, regex, choice, grammar, ...)
    # whose grammar was ready, those whose grammar failed to build, grammars compiled and their seconds
    structured_requests: dict[str, int] = msgspec.field(default_factory=dict)
    structured_failed: int = 0
    grammar_compiles: int = 0
    grammar_compile_seconds: float = 0.0
    # KV transfer (disaggregated prefill/decode), cumulative: KV bytes sent (producer) and received (consumer),
    # the consumers' seconds from asking for a prompt's blocks to the last one in, blocks received, and pulls
    # that failed (the consumer then computed the prompt itself)
    kv_transfer_bytes_sent: int = 0
    kv_transfer_bytes_received: int = 0
    kv_transfer_seconds: float = 0.0
    kv_transfer_blocks_received: int = 0
    kv_transfer_failures: int = 0
    step: StepStats | None = None


class SpecDecodeStats:
    """The scheduler's running speculative-decoding counters (SchedulerStats carries a copy)."""

    def __init__(self) -> None:
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.accepted_per_pos: list[int] = []

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_draft_tokens:
            self.accepted_per_pos.extend([0] * (num_draft_tokens - len(self.accepted_per_pos)))
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1


def spec_decode_summary(before: SchedulerStats | None, after: SchedulerStats) -> dict[str, object]:
    """Acceptance over the steps between two stats: the counters, the acceptance rate, the mean accepted
    length (tokens a verification takes: accepted drafts and one more) and the rate per draft position."""
    b = before or SchedulerStats()
    drafts = after.spec_num_drafts - b.spec_num_drafts
    tokens = after.spec_num_draft_tokens - b.spec_num_draft_tokens
    accepted = after.spec_num_accepted_tokens - b.spec_num_accepted_tokens
    per_pos = [n - (b.spec_num_accepted_tokens_per_pos[i] if i < len(b.spec_num_accepted_tokens_per_pos) else 0)
               for i, n in enumerate(after.spec_num_accepted_tokens_per_pos)]
    return {
        "spec_num_drafts": drafts, "spec_num_draft_tokens": tokens, "spec_num_accepted_tokens": accepted,
        "spec_acceptance_rate": round(accepted / tokens, 4) if tokens else None,
        "spec_mean_accepted_length": round(1 + accepted / drafts, 4) if drafts else None,
        "spec_acceptance_rate_per_pos": [round(n / drafts, 4) for n in per_pos] if drafts else [],
    }


class EngineCoreOutputs(msgspec.Struct, omit_defaults=True):
    outputs: list[EngineCoreOutput] = msgspec.field(default_factory=list)
    stats: SchedulerStats | None = None
    timestamp: float = 0.0
    # request id -> when the scheduler first scheduled it, for those first scheduled since the last outputs
    scheduled: dict[str, float] = msgspec.field(default_factory=dict)
