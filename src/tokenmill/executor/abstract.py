"""What the engine core needs of the workers, however many and wherever they run.

An executor owns one worker per rank and reaches them all with `collective_rpc(method, args)`: the
same `Worker` method on every rank, the results in rank order. On top of it the base class plans the
KV cache from the workers' layer specs and has every worker allocate it. In-process (uniproc.py) is
one implementation; a process per rank (multiproc.py, tensor parallelism) another; `create_executor`
(executor/__init__.py) picks one by `ParallelConfig.distributed_executor_backend`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future
from typing import Any

from tokenmill.config import EngineConfig
from tokenmill.core.sched_output import ModelRunnerOutput, SchedulerOutput
from tokenmill.kv_cache_spec import KVCacheConfig, KVCacheSpec, plan_kv_cache


class WorkerDied(RuntimeError):
    """A worker process is gone (or failed in a way that leaves its group out of step): the executor
    cannot run another step, and the engine ends every request with this error."""


class Executor(ABC):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.kv_cache_config: KVCacheConfig | None = None

    @abstractmethod
    def collective_rpc(self, method: str, args: tuple[Any, ...] = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Call `method` on every worker; their results in rank order."""

    @abstractmethod
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on the workers and return the driver's output."""

    @abstractmethod
    def submit(self, so: SchedulerOutput) -> Future[ModelRunnerOutput]:
        """Queue a step behind those submitted before it (async scheduling)."""

    @abstractmethod
    def shutdown(self) -> None: ...

    def check_health(self) -> None:
        """Raise WorkerDied where a worker is gone (checked while the engine is idle, too); an
        in-process worker cannot be gone without the engine."""
        return None

    def initialize_kv_cache(self) -> KVCacheConfig:
        """Plan the pool from the workers' attention layer specs within the cache budget (all ranks'), have every
        worker allocate it, and return the plan (its num_blocks sizes the scheduler's block pool). Pipeline
        stages hold different layers: each stage gets its own plan, all with the blocks of the tightest
        one (a block id names the same tokens on every stage), and the first stage's plan is returned."""
        specs: list[dict[str, KVCacheSpec]] = self.collective_rpc("get_kv_cache_specs")
        parallel = self.config.parallel
        stages = [specs[stage * parallel.tensor_parallel_size] for stage in range(parallel.pipeline_parallel_size)]
        if any(s != stages[parallel.stage_of(rank)] for rank, s in enumerate(specs)):
            raise ValueError("workers of one pipeline stage declare different KV cache layers")
        cache = self.config.cache
        # the ranks share this machine's memory: each takes its share of the budget, so the pool's bytes
        # in all are the budget (and its tokens one rank's, where no KV head is replicated)
        budget = cache.kv_cache_bytes // parallel.world_size
        num_blocks = cache.num_kv_blocks
        if num_blocks is None and len(stages) > 1:
            num_blocks = min(plan_kv_cache(s, budget).num_blocks for s in stages)
        plans = [plan_kv_cache(s, budget, num_blocks) for s in stages]
        self.kv_cache_config = plans[0]
        self.collective_rpc("initialize_kv_cache", (plans if len(plans) > 1 else plans[0],))
        return self.kv_cache_config
