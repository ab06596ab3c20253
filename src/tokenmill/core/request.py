"""Engine-side state of one sequence."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

from tokenmill.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenmill.core.messages import KVTransferParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6  # preparing or sampling it failed; the engine goes on with the others

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


class PriorityClass(enum.IntEnum):
    """Which kind of work a request is; a lower class is scheduled first (vLLM's `priority` field orders
    requests within a class)."""
    INTERACTIVE = 0  # API traffic with a client waiting
    BATCH = 1  # lines of a batch job (/v1/batches, run-batch): run in the capacity interactive work leaves


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """A sequence as the scheduler sees it: token ids, progress, status, KV hashes."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: tuple[int, ...] = (),
        arrival_time: float | None = None,
        priority: int = 0,
        priority_class: int = PriorityClass.INTERACTIVE,
        group: str = "",
        hold_kv: bool = False,
        kv_parent: str | None = None,
        kv_transfer: KVTransferParams | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.priority = priority
        self.priority_class = int(priority_class)
        self.group = group  # the batch a request belongs to: the scheduler takes turns between groups
        self.fair_round = 0  # its turn within its group, set by the scheduler when it is added
        self.hold_kv = hold_kv  # once finished, its blocks stay (Scheduler.held) until it is aborted
        self.kv_parent = kv_parent  # a held request whose blocks this one starts from, if still held
        self.kv_transfer = kv_transfer  # disaggregated prefill/decode: produce for, or pull from, another instance
        self.kv_pulled = False  # its prompt's blocks were asked of a producer (core/kv_transfer.py)
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0  # tokens whose KV is computed or scheduled to be
        # tokens being sampled by scheduled steps whose output is not in yet (async scheduling: up to 2)
        self.num_output_placeholders = 0
        self.num_cached_tokens = -1  # prefix-cache hit tokens at first schedule; -1 until then
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.block_hashes: list[int] = []
        self.spec_token_ids: list[int] = []  # draft tokens proposed to follow, for the next step to verify

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
