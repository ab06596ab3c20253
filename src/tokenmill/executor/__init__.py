"""The executors: the workers behind one interface (abstract.py)."""

from __future__ import annotations

from tokenmill.config import EngineConfig
from tokenmill.executor.abstract import Executor


def create_executor(config: EngineConfig) -> Executor:
    """The executor `config.parallel.distributed_executor_backend` names (validated at start-up)."""
    if config.parallel.distributed_executor_backend == "mp":
        from tokenmill.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config)
    if config.parallel.distributed_executor_backend == "ray":
        from tokenmill.executor.ray import RayExecutor

        return RayExecutor(config)
    from tokenmill.executor.uniproc import UniProcExecutor

    return UniProcExecutor(config)
