"""The engine core: scheduler + executor, stepping requests until they finish. It speaks
only in typed messages (EngineCoreRequest in, EngineCoreOutputs out), so it can run in
this process or in its own (core_proc)."""

from __future__ import annotations

import time
from collections.abc import Iterable

from tokenmill.config import EngineConfig
from tokenmill.core.messages import EngineCoreOutputs, EngineCoreRequest
from tokenmill.core.request import Request
from tokenmill.core.scheduler import Scheduler
from tokenmill.executor.uniproc import UniProcExecutor


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.executor = UniProcExecutor(config)
        num_blocks = self.executor.num_blocks
        capacity = num_blocks * config.cache.block_size
        if capacity < config.model.max_model_len:
            raise ValueError(
                f"the KV cache holds {capacity} tokens ({num_blocks} blocks), fewer than max_model_len "
                f"({config.model.max_model_len}): raise kv_cache_memory or lower max_model_len"
            )
        self.scheduler = Scheduler(config.scheduler, config.cache, num_blocks)
        self.num_blocks = num_blocks

    def add_request(self, req: EngineCoreRequest) -> None:
        if req.request_id in self.scheduler.requests:
            raise ValueError(f"request id {req.request_id!r} is already running")
        self.scheduler.add_request(Request(req.request_id, req.prompt_token_ids, req.sampling_params,
                                           req.eos_token_ids, req.arrival_time or None, req.priority))

    def abort_requests(self, request_ids: Iterable[str]) -> EngineCoreOutputs:
        return EngineCoreOutputs(self.scheduler.abort_requests(request_ids), self.scheduler.stats(), time.time())

    def step(self) -> EngineCoreOutputs:
        if not self.scheduler.has_unfinished_requests():
            return EngineCoreOutputs([], self.scheduler.stats(), time.time())
        so = self.scheduler.schedule()
        runner_out = self.executor.execute_model(so)
        outputs = self.scheduler.update_from_output(so, runner_out)
        return EngineCoreOutputs(outputs, self.scheduler.stats(), time.time())

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.kv.reset_prefix_cache()
