"""The synchronous engine: InputProcessor -> EngineCore (in this process) -> OutputProcessor.
Used by the offline `LLM` API and by tests."""

from __future__ import annotations

import itertools
import time
from typing import Any

from tokenmill.config import EngineArgs, EngineConfig
from tokenmill.core.messages import SchedulerStats
from tokenmill.engine.core import EngineCore
from tokenmill.engine.input_processor import InputProcessor, KVSharing, PromptType, load_tokenizer
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams


def child_requests(request_id: str, params: SamplingParams) -> list[tuple[str, SamplingParams]]:
    """n > 1 fans out into n sequences; a seeded parent gives child i the seed + i."""
    if params.n == 1:
        return [(request_id, params)]
    return [(f"{request_id}#{i}", params.clone(n=1, seed=None if params.seed is None else params.seed + i))
            for i in range(params.n)]


class LLMEngine:
    def __init__(self, config: EngineConfig, skip_tokenizer_init: bool = False) -> None:
        self.config = config
        self.tokenizer = None if skip_tokenizer_init else load_tokenizer(config.model.tokenizer)
        self.input_processor = InputProcessor(config.model, self.tokenizer, config.structured_outputs.backend)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.core = EngineCore(config)
        self.stats = SchedulerStats()
        self._ids = itertools.count()

    @classmethod
    def from_engine_args(cls, args: EngineArgs, skip_tokenizer_init: bool = False) -> LLMEngine:
        return cls(args.create_engine_config(), skip_tokenizer_init)

    def add_request(self, request_id: str | None, prompt: PromptType, params: SamplingParams,
                    priority: int = 0, kv: KVSharing | None = None) -> str:
        if not isinstance(params, SamplingParams):
            raise ValueError("sampling params must be a SamplingParams")
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.output_processor.parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        processed = self.input_processor.tokenize(prompt)
        now = time.time()
        children = child_requests(request_id, params)
        # validate all before registering any: a rejected request must leave nothing behind
        requests = [self.input_processor.make_request(cid, processed, cp, priority, now, kv=kv)
                    for cid, cp in children]
        self.output_processor.add_request(request_id, processed.prompt, processed.prompt_token_ids, params,
                                          [cid for cid, _ in children], now)
        try:
            for req in requests:
                self.core.add_request(req)
        except BaseException:  # (the core took none: its ids are checked before it adds any)
            self.output_processor.abort(request_id)
            raise
        return request_id

    def release_kv(self, request_ids: list[str]) -> None:
        """Release the blocks that finished requests added with KVSharing(hold=True) keep."""
        self.core.abort_requests(request_ids)

    def abort_request(self, request_ids: list[str]) -> list[RequestOutput]:
        results = []
        for rid in request_ids:
            self.core.abort_requests(self.output_processor.child_ids(rid))
            out = self.output_processor.abort(rid)
            if out is not None:
                results.append(out)
        return results

    def step(self) -> list[RequestOutput]:
        core_out = self.core.step()
        if core_out.stats is not None:
            self.stats = core_out.stats
        self.output_processor.record_scheduled(core_out.scheduled)
        results, to_stop = self.output_processor.process(core_out.outputs)
        if to_stop:
            self.core.abort_requests(to_stop)
        return results

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished() or self.core.has_unfinished_requests()

    def reset_prefix_cache(self) -> bool:
        return self.core.reset_prefix_cache()

    def get_tokenizer(self) -> Any:
        return self.tokenizer
