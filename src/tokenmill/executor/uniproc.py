"""One worker in this process: the executor for a single device."""

from __future__ import annotations

import sys
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

from tokenmill.config import EngineConfig
from tokenmill.core.sched_output import ModelRunnerOutput, SchedulerOutput
from tokenmill.executor.abstract import Executor

# While a step runs on the worker thread, the engine core's thread runs Python beside it, and the
# step's thread needs the GIL back between its kernels. CPython hands the GIL over only every "switch
# interval" (5 ms by default), so a kernel's return could wait that long for the other thread's
# Python; 50 us keeps the wait short (bench/README.md, 'Measurements behind the code').
_SWITCH_INTERVAL_S = 5e-5


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        from tokenmill.worker.worker import Worker

        super().__init__(config)
        self.worker = Worker(config)
        self._thread: ThreadPoolExecutor | None = None
        self._switch_interval = 0.0
        self._last: Future[ModelRunnerOutput] | None = None  # the step submitted last
        self._last_launched = False  # whether it was launched (ModelRunner.launch)

    @property
    def runner(self) -> Any:
        """The worker's model runner (once the KV cache is initialized)."""
        return self.worker.model_runner

    def collective_rpc(self, method: str, args: tuple[Any, ...] = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        return [getattr(self.worker, method)(*args, **(kwargs or {}))]

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(so)

    def submit(self, so: SchedulerOutput) -> Future[ModelRunnerOutput]:
        """Prepare the step's inputs here, then run it on the worker thread after the steps submitted
        before it. The kernels release the GIL, so the caller's Python (the next schedule, output
        processing) runs beside the step's compute.

        A step the runner can launch (ModelRunner.launchable: pure-decode greedy steps on a GPU) is
        queued on the device here instead, and the worker thread only waits for its tokens: the GPU
        then runs it right behind the step before, whose tokens it takes on the device. It is queued
        only behind steps whose kernels are all queued: a step the worker thread runs is waited for
        first."""
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="tokenmill-step")
            self._switch_interval = sys.getswitchinterval()
            sys.setswitchinterval(min(self._switch_interval, _SWITCH_INTERVAL_S))
        runner = self.worker.runner()
        prepared = runner.prepare(so)
        if prepared is not None and runner.launchable(prepared):
            if self._last is not None and not self._last_launched:
                wait([self._last])  # (its failure is the caller's, through its own future)
            launched = runner.launch(prepared)
            if launched is not None:
                return self._queued(self._thread.submit(runner.finish, launched), True)
        return self._queued(self._thread.submit(runner.execute, prepared), False)

    def _queued(self, future: Future[ModelRunnerOutput], launched: bool) -> Future[ModelRunnerOutput]:
        self._last, self._last_launched = future, launched
        return future

    def shutdown(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None
            sys.setswitchinterval(self._switch_interval)
