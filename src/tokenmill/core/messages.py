"""Typed messages between the engine front end and the engine core (in-process or over IPC)."""

from __future__ import annotations

import msgspec

from tokenmill.sampling_params import SamplingParams

# One position's logprobs, as the sampler makes them and the wire carries them: parallel lists
# (token ids, logprobs, ranks); index 0 is the sampled/actual token, the rest are the top-N in order.
LogprobEntry = tuple[list[int], list[float], list[int]]


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = 0.0
    priority: int = 0


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


class EngineCoreOutputs(msgspec.Struct, omit_defaults=True):
    outputs: list[EngineCoreOutput] = msgspec.field(default_factory=list)
    stats: SchedulerStats | None = None
    timestamp: float = 0.0
    # request id -> when the scheduler first scheduled it, for those first scheduled since the last outputs
    scheduled: dict[str, float] = msgspec.field(default_factory=dict)
