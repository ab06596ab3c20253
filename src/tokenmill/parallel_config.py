"""How the model is spread over processes: the tensor- and pipeline-parallel sizes, the executor that
runs the ranks, and each pipeline stage's layers, validated once at start-up (torch-free, like the
other descriptions).

The world is tensor_parallel_size x pipeline_parallel_size ranks, laid out as vLLM's: the tensor-parallel
ranks of one stage are consecutive, rank = stage * tensor_parallel_size + tp_rank."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from tokenmill.arch import ArchConfig

# uni: one worker in the engine core's process; mp: one process per rank on this machine (the default
# above one rank); ray: a Ray actor per rank, placed on a Ray cluster (executor/ray.py)
DISTRIBUTED_EXECUTOR_BACKENDS = ("uni", "mp", "ray")
# the architectures whose model shards its layers and splits its layer stack (models/llama.py)
TENSOR_PARALLEL_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                                 "Phi3ForCausalLM")


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    distributed_executor_backend: str = "uni"
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1  # engine-core replicas behind one server (each of world_size ranks)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def output_rank(self) -> int:
        """The rank whose step output the executor returns: the last stage's first tensor-parallel rank
        (the last stage samples)."""
        return (self.pipeline_parallel_size - 1) * self.tensor_parallel_size

    def stage_of(self, rank: int) -> int:
        """The pipeline stage that `rank` belongs to."""
        return rank // self.tensor_parallel_size

    def threads_per_rank(self, total: int) -> int:
        """Each rank's share of `total` compute threads (at least one)."""
        return max(1, total // self.world_size)


def pp_layer_range(num_layers: int, stage: int, stages: int) -> tuple[int, int]:
    """Stage `stage`'s layers [start, end) of `num_layers` split over `stages` contiguous ranges: vLLM's
    rule (get_pp_indices), equal ranges with the remainder given one layer each to the stages before the
    last, from the second-to-last backwards (the last stage also runs the final norm and the lm_head)."""
    sizes = [num_layers // stages] * stages
    for i in range(2, num_layers % stages + 2):
        sizes[-i] += 1
    start = sum(sizes[:stage])
    return start, start + sizes[stage]


def resolve_parallel_config(tensor_parallel_size: int, backend: str | None, arch: ArchConfig, device: str,
                            runner: str, quantized: bool, speculative: bool,
                            pipeline_parallel_size: int = 1) -> ParallelConfig:
    """A ParallelConfig, or one ValueError that says what to change."""
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    for name, size in (("tensor_parallel_size", tp), ("pipeline_parallel_size", pp)):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {size!r}")
    world = tp * pp
    if backend is None:
        backend = "mp" if world > 1 else "uni"
    if backend not in DISTRIBUTED_EXECUTOR_BACKENDS:
        raise ValueError(f"distributed_executor_backend must be one of {list(DISTRIBUTED_EXECUTOR_BACKENDS)}, "
                         f"got {backend!r}")
    if backend == "ray" and importlib.util.find_spec("ray") is None:
        raise ValueError("distributed_executor_backend 'ray' needs Ray, which is not installed: "
                         "pip install 'tokenmill[ray]' (or use 'mp', a process per rank on this machine)")
    if backend == "uni" and world > 1:
        sizes = " x ".join(f"{n} {s}" for n, s in (("tensor_parallel_size", tp), ("pipeline_parallel_size", pp))
                           if s > 1)
        raise ValueError(f"distributed_executor_backend 'uni' runs one rank; {sizes} needs 'mp'")
    if world > 1:
        _check_supported("tensor" if pp == 1 else "pipeline" if tp == 1 else "tensor x pipeline",
                         tp if pp == 1 else pp, arch, device, runner, quantized, speculative)
    if tp > 1:
        _check_tensor_parallel(tp, arch)
    if pp > arch.num_layers:
        raise ValueError(f"pipeline_parallel_size {pp} is more than the model's {arch.num_layers} layers "
                         "(each stage holds at least one)")
    return ParallelConfig(tp, backend, pp)


def _check_supported(kind: str, size: int, arch: ArchConfig, device: str, runner: str, quantized: bool,
                     speculative: bool) -> None:
    """What any world above one rank needs, said for the parallelism `kind` the sizes ask for."""
    one = "tensor_parallel_size 1 and pipeline_parallel_size 1"
    if arch.architecture not in TENSOR_PARALLEL_ARCHITECTURES:
        raise ValueError(f"{kind} parallelism is built for {', '.join(TENSOR_PARALLEL_ARCHITECTURES)}; "
                         f"{arch.architecture} runs with {one}")
    if device != "cpu":
        raise ValueError(f"{kind} parallelism runs on the CPU (gloo) so far; use --device cpu or {one}")
    if runner != "generate" or quantized or speculative:
        what = "an embedding model" if runner != "generate" else "quantized weights" if quantized else \
            "speculative decoding"
        raise ValueError(f"{kind} parallelism does not support {what} yet; use {one}")


def _check_tensor_parallel(tp: int, arch: ArchConfig) -> None:
    if arch.num_heads % tp:
        raise ValueError(f"tensor_parallel_size {tp} must divide the model's {arch.num_heads} attention heads")
    kv = arch.num_kv_heads
    if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
        raise ValueError(f"tensor_parallel_size {tp} and the model's {kv} KV heads must divide one another "
                         "(each rank holds a share of them, or one replicated)")
    if arch.intermediate_size % tp:
        raise ValueError(f"tensor_parallel_size {tp} must divide the model's intermediate size "
                         f"{arch.intermediate_size}")
