"""One worker in this process: the executor for a single device."""

from __future__ import annotations

from tokenmill.config import EngineConfig
from tokenmill.core.sched_output import ModelRunnerOutput, SchedulerOutput


class UniProcExecutor:
    def __init__(self, config: EngineConfig) -> None:
        from tokenmill.worker.model_runner import ModelRunner

        self.runner = ModelRunner(config)

    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(so)
