"""How the model is spread over processes: the tensor-parallel size and the executor that runs the
ranks, validated once at start-up (torch-free, like the other descriptions)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from tokenmill.arch import ArchConfig

# uni: one worker in the engine core's process; mp: one process per rank on this machine (the default
# above one rank); ray: a Ray actor per rank, placed on a Ray cluster (executor/ray.py)
DISTRIBUTED_EXECUTOR_BACKENDS = ("uni", "mp", "ray")
# the architectures whose model shards its layers (models/llama.py)
TENSOR_PARALLEL_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                                 "Phi3ForCausalLM")


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    distributed_executor_backend: str = "uni"
    data_parallel_size: int = 1  # engine-core replicas behind one server (each of world_size ranks)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size

    def threads_per_rank(self, total: int) -> int:
        """Each rank's share of `total` compute threads (at least one)."""
        return max(1, total // self.world_size)


def resolve_parallel_config(tensor_parallel_size: int, backend: str | None, arch: ArchConfig, device: str,
                            runner: str, quantized: bool, speculative: bool) -> ParallelConfig:
    """A ParallelConfig, or one ValueError that says what to change."""
    tp = tensor_parallel_size
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {tp!r}")
    if backend is None:
        backend = "mp" if tp > 1 else "uni"
    if backend not in DISTRIBUTED_EXECUTOR_BACKENDS:
        raise ValueError(f"distributed_executor_backend must be one of {list(DISTRIBUTED_EXECUTOR_BACKENDS)}, "
                         f"got {backend!r}")
    if backend == "ray" and importlib.util.find_spec("ray") is None:
        raise ValueError("distributed_executor_backend 'ray' needs Ray, which is not installed: "
                         "pip install 'tokenmill[ray]' (or use 'mp', a process per rank on this machine)")
    if backend == "uni" and tp > 1:
        raise ValueError(f"distributed_executor_backend 'uni' runs one rank; tensor_parallel_size {tp} needs 'mp'")
    if tp > 1:
        _check_tensor_parallel(tp, arch, device, runner, quantized, speculative)
    return ParallelConfig(tp, backend)


def _check_tensor_parallel(tp: int, arch: ArchConfig, device: str, runner: str, quantized: bool,
                           speculative: bool) -> None:
    if arch.architecture not in TENSOR_PARALLEL_ARCHITECTURES:
        raise ValueError(f"tensor parallelism is built for {', '.join(TENSOR_PARALLEL_ARCHITECTURES)}; "
                         f"{arch.architecture} runs with tensor_parallel_size 1")
    if device != "cpu":
        raise ValueError("tensor parallelism runs on the CPU (gloo) so far; use --device cpu or "
                         "tensor_parallel_size 1")
    if runner != "generate" or quantized or speculative:
        what = "an embedding model" if runner != "generate" else "quantized weights" if quantized else \
            "speculative decoding"
        raise ValueError(f"tensor parallelism does not support {what} yet; use tensor_parallel_size 1")
    if arch.num_heads % tp:
        raise ValueError(f"tensor_parallel_size {tp} must divide the model's {arch.num_heads} attention heads")
    kv = arch.num_kv_heads
    if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
        raise ValueError(f"tensor_parallel_size {tp} and the model's {kv} KV heads must divide one another "
                         "(each rank holds a share of them, or one replicated)")
    if arch.intermediate_size % tp:
        raise ValueError(f"tensor_parallel_size {tp} must divide the model's intermediate size "
                         f"{arch.intermediate_size}")
