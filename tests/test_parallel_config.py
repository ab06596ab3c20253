"""--tensor-parallel-size and --distributed-executor-backend: what is refused at start-up, with one
message that says what to change."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tokenmill.arch import load_arch_config
from tokenmill.config import EngineArgs
from tokenmill.parallel_config import ParallelConfig, resolve_parallel_config


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
    ("ray", 2, "'ray' is not built yet; use 'mp'"),
    ("threads", 1, r"distributed_executor_backend must be one of \['uni', 'mp', 'ray'\], got 'threads'"),
    ("uni", 2, "'uni' runs one rank; tensor_parallel_size 2 needs 'mp'"),
])
def test_backends_refused(llama_dir: str, backend: str, tp: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EngineArgs(llama_dir, tensor_parallel_size=tp, distributed_executor_backend=backend).create_engine_config()


@pytest.mark.parametrize("tiers", [{"kv_offload_memory": "64MiB"},
                                   {"preemption_mode": "swap", "kv_offload_memory": "64MiB"},
                                   {"kv_offload_disk": "DIR", "kv_offload_disk_size": "64MiB"}])
def test_kv_tiers_refused_with_tensor_parallelism(llama_dir: str, tiers: dict[str, str], tmp_path: Path) -> None:
    # a rank's blocks hold only its heads, so the tiers (which move rank 0's bytes) are refused at start
    tiers = {k: str(tmp_path / "kv") if v == "DIR" else v for k, v in tiers.items()}
    with pytest.raises(ValueError, match="not built for tensor or pipeline parallelism"):
        EngineArgs(llama_dir, tensor_parallel_size=2, **tiers).create_engine_config()  # type: ignore[arg-type]
    EngineArgs(llama_dir, tensor_parallel_size=1, **tiers).create_engine_config()  # type: ignore[arg-type]
