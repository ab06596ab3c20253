"""--tensor-parallel-size, --pipeline-parallel-size and --distributed-executor-backend: what is refused at
start-up, with one message that says what to change; the pipeline stages' layer ranges."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tokenmill.arch import load_arch_config
from tokenmill.config import EngineArgs
from tokenmill.parallel_config import ParallelConfig, pp_layer_range, resolve_parallel_config


def resolve(arch: object, tp: int, backend: str | None = None, **kw: object) -> ParallelConfig:
    opts = {"device": "cpu", "runner": "generate", "quantized": False, "speculative": False, **kw}
    return resolve_parallel_config(tp, backend, arch, **opts)  # type: ignore[arg-type]


def test_defaults(llama_dir: str) -> None:
    assert EngineArgs(llama_dir).create_engine_config().parallel == ParallelConfig(1, "uni")
    config = EngineArgs(llama_dir, tensor_parallel_size=2).create_engine_config()
    assert config.parallel == ParallelConfig(2, "mp") and config.parallel.threads_per_rank(5) == 2
    assert EngineArgs(llama_dir, distributed_executor_backend="mp").create_engine_config().parallel.world_size == 1


@pytest.mark.parametrize(("tp", "match"), [
    (3, "tensor_parallel_size 3 must divide the model's 4 attention heads"),
    (0, "tensor_parallel_size must be an integer >= 1, got 0"),
    (-2, "tensor_parallel_size must be an integer >= 1"),
    (8, "must divide the model's 4 attention heads"),
])
def test_sizes_refused(llama_dir: str, tp: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EngineArgs(llama_dir, tensor_parallel_size=tp).create_engine_config()


def test_kv_heads_and_intermediate_size_must_divide(llama_dir: str) -> None:
    arch = load_arch_config(llama_dir)
    assert resolve(arch, 4).tensor_parallel_size == 4  # 2 KV heads over 4 ranks: each replicated twice
    with pytest.raises(ValueError, match="tensor_parallel_size 2 and the model's 3 KV heads"):
        resolve(dataclasses.replace(arch, num_heads=6, num_kv_heads=3), 2)
    with pytest.raises(ValueError, match="tensor_parallel_size 4 and the model's 3 KV heads"):
        resolve(dataclasses.replace(arch, num_heads=12, num_kv_heads=3), 4)
    with pytest.raises(ValueError, match="intermediate size 130"):
        resolve(dataclasses.replace(arch, intermediate_size=130), 4)


def test_what_tensor_parallel_does_not_run(llama_dir: str, model_dirs: dict[str, str]) -> None:
    arch = load_arch_config(llama_dir)
    with pytest.raises(ValueError, match="Gemma2ForCausalLM runs with tensor_parallel_size 1"):
        resolve(load_arch_config(model_dirs["gemma2-softcap"]), 2)
    with pytest.raises(ValueError, match="runs on the CPU"):
        resolve(arch, 2, device="cuda")
    with pytest.raises(ValueError, match="quantized weights"):
        resolve(arch, 2, quantized=True)
    with pytest.raises(ValueError, match="speculative decoding"):
        resolve(arch, 2, speculative=True)
    with pytest.raises(ValueError, match="quantized weights"):
        EngineArgs(llama_dir, tensor_parallel_size=2, quantization="int8").create_engine_config()


@pytest.mark.parametrize(("backend", "tp", "match"), [
    ("threads", 1, r"distributed_executor_backend must be one of \['uni', 'mp', 'ray'\], got 'threads'"),
    ("uni", 2, "'uni' runs one rank; tensor_parallel_size 2 needs 'mp'"),
])
def test_backends_refused(llama_dir: str, backend: str, tp: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EngineArgs(llama_dir, tensor_parallel_size=tp, distributed_executor_backend=backend).create_engine_config()


def test_ray_backend_without_ray(llama_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else find_spec(name, *a))
    with pytest.raises(ValueError, match=r"'ray' needs Ray, which is not installed: pip install 'tokenmill\[ray\]'"):
        EngineArgs(llama_dir, tensor_parallel_size=2, distributed_executor_backend="ray").create_engine_config()


@pytest.mark.parametrize("tiers", [{"kv_offload_memory": "64MiB"},
                                   {"preemption_mode": "swap", "kv_offload_memory": "64MiB"},
                                   {"kv_offload_disk": "DIR", "kv_offload_disk_size": "64MiB"}])
def test_kv_tiers_refused_with_tensor_parallelism(llama_dir: str, tiers: dict[str, str], tmp_path: Path) -> None:
    # a rank's blocks hold only its heads, so the tiers (which move rank 0's bytes) are refused at start
    tiers = {k: str(tmp_path / "kv") if v == "DIR" else v for k, v in tiers.items()}
    with pytest.raises(ValueError, match="not built for tensor or pipeline parallelism"):
        EngineArgs(llama_dir, tensor_parallel_size=2, **tiers).create_engine_config()  # type: ignore[arg-type]
    EngineArgs(llama_dir, tensor_parallel_size=1, **tiers).create_engine_config()  # type: ignore[arg-type]


@pytest.mark.parametrize(("layers", "stages", "sizes"), [
    (2, 2, [1, 1]),
    (4, 2, [2, 2]),
    (3, 2, [2, 1]),  # the remainder before the last stage (it also runs the norm and the lm_head)
    (22, 4, [5, 6, 6, 5]),
    (61, 4, [15, 15, 16, 15]),
    (5, 5, [1] * 5),
])
def test_stage_layers(layers: int, stages: int, sizes: list[int]) -> None:
    """vLLM's split (get_pp_indices): contiguous ranges covering every layer once."""
    ranges = [pp_layer_range(layers, s, stages) for s in range(stages)]
    assert [end - start for start, end in ranges] == sizes
    assert ranges[0][0] == 0 and ranges[-1][1] == layers
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


def test_pipeline_sizes(llama_dir: str, model_dirs: dict[str, str]) -> None:
    config = EngineArgs(llama_dir, pipeline_parallel_size=2, tensor_parallel_size=2).create_engine_config()
    parallel = config.parallel
    assert parallel == ParallelConfig(2, "mp", 2) and parallel.world_size == 4 and parallel.output_rank == 2
    assert [parallel.stage_of(r) for r in range(4)] == [0, 0, 1, 1]
    arch = load_arch_config(llama_dir)
    for kw, match in [
        ({"pipeline_parallel_size": 3}, "pipeline_parallel_size 3 is more than the model's 2 layers"),
        ({"pipeline_parallel_size": 0}, "pipeline_parallel_size must be an integer >= 1, got 0"),
        ({"pipeline_parallel_size": 2, "distributed_executor_backend": "uni"},
         "'uni' runs one rank; pipeline_parallel_size 2 needs 'mp'"),
        ({"pipeline_parallel_size": 2, "tensor_parallel_size": 3}, "tensor_parallel_size 3 must divide"),
        ({"pipeline_parallel_size": 2, "kv_offload_memory": "64MiB"}, "not built for tensor or pipeline"),
    ]:
        with pytest.raises(ValueError, match=match):
            EngineArgs(llama_dir, **kw).create_engine_config()  # type: ignore[arg-type]
    gemma = load_arch_config(model_dirs["gemma2-softcap"])
    with pytest.raises(ValueError, match="Gemma2ForCausalLM runs with tensor_parallel_size 1 and pipeline_para"):
        resolve_parallel_config(1, None, gemma, "cpu", "generate", False, False, 2)
    for what, kw2 in [("speculative decoding", {"speculative": True}), ("quantized weights", {"quantized": True}),
                      ("an embedding model", {"runner": "pooling"})]:
        opts = {"device": "cpu", "runner": "generate", "quantized": False, "speculative": False, **kw2}
        with pytest.raises(ValueError, match=f"pipeline parallelism does not support {what}"):
            resolve_parallel_config(1, None, arch, pipeline_parallel_size=2, **opts)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tensor x pipeline parallelism runs on the CPU"):
        resolve_parallel_config(2, None, arch, "cuda", "generate", False, False, 2)
