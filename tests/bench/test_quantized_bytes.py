"""Weight bytes of quantized models: ModelCost's arithmetic equals the bytes a loaded quantized model
holds; `tokenmill plan` lists them per format, and `bench latency` reports both with --quantization."""

from __future__ import annotations

import json

import pytest
import torch

from tests.bench.test_latency_roofline import last_json
from tokenmill.arch import load_arch_config
from tokenmill.bench.model_math import QUANTIZED_FORMATS, ModelCost
from tokenmill.config import EngineArgs
from tokenmill.entrypoints.cli import main
from tokenmill.kernels import load_cpu_kernels
from tokenmill.layers.quantization import quantized_kernels
from tokenmill.quantization_config import RTN_LM_HEAD_METHODS
from tokenmill.worker.worker import Worker


@pytest.mark.parametrize("fmt", QUANTIZED_FORMATS)
def test_model_cost_counts_the_loaded_bytes(model_dirs: dict[str, str], fmt: str) -> None:
    # (the mixtures of experts: every expert's projections and a shared expert's are quantized, the routers not)
    for name in ("llama-gqa4-untied", "llama-gqa2-tied", "mixtral-8x-top2", "qwen2moe-shared"):
        d = model_dirs[name]
        config = EngineArgs(d, dtype="float32", quantization=fmt, kv_cache_memory="8MiB").create_engine_config()
        worker = Worker(config)
        cost = ModelCost(load_arch_config(d), "float32", quantization=fmt, lm_head_int8=fmt in RTN_LM_HEAD_METHODS)
        # W8A8's oneDNN-packed copy for large batches (its padding is oneDNN's) is not in ModelCost
        onednn = sum(int(torch.ops.mkldnn._nbytes(m.onednn_qweight)) for m in worker.model.modules()
                     if hasattr(m, "onednn_qweight"))
        # (where this CPU runs the VNNI kernels, which W8A8 needs to take oneDNN's path for large batches)
        assert (onednn > 0) == (fmt == "w8a8" and quantized_kernels(load_cpu_kernels(), "w8a8") is not None)
        # a tied lm_head that oneDNN packed (W8A8's float lm_head, where oneDNN packs float32: an AVX2-only CPU)
        # is a reordered copy of the embedding, a tensor of its own; int8 and int4 hold an int8 lm_head, which
        # ModelCost counts (beside a tied embedding's float table)
        head = getattr(worker.model.lm_head, "weight", None)
        tied_copy = (int(torch.ops.mkldnn._nbytes(head))
                     if load_arch_config(d).tie_word_embeddings and head is not None and head.is_mkldnn else 0)
        assert (head is None) == (fmt in RTN_LM_HEAD_METHODS), name
        assert worker.weight_bytes() - onednn - tied_copy == cost.weight_bytes, name
        assert cost.weight_bytes < ModelCost(load_arch_config(d), "float32").weight_bytes


def test_plan_lists_weight_bytes_per_format(model_dirs: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    d = model_dirs["llama-gqa4-untied"]
    assert main(["plan", d, "--dtype", "bfloat16", "--json", "--bandwidth", "1",
                 "--flops", "1"]) == 0
    by = json.loads(capsys.readouterr().out)["weight_bytes_by_format"]
    assert list(by) == ["bfloat16", "int8", "w8a8", "int4"]
    # int8 keeps row sums too, as W8A8 does, and rounds the lm_head as well (W8A8 leaves it bf16)
    assert by["int4"] < by["int8"] < by["w8a8"] < by["bfloat16"]
    arch = load_arch_config(d)
    assert by["w8a8"] - by["int8"] == arch.vocab_size * arch.hidden_size - arch.vocab_size * 8
    assert main(["plan", d, "--dtype", "bfloat16", "--bandwidth", "1", "--flops", "1"]) == 0
    assert "int4 " in capsys.readouterr().out


def test_latency_bench_reports_quantized_weight_bytes(model_dirs: dict[str, str],
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    # an untied model: a tied lm_head that oneDNN packs is a copy of the embedding (the test above counts it)
    llama_dir = model_dirs["llama-gqa4-untied"]
    argv = ["bench", "latency", "--model", llama_dir, "--dtype", "float32", "--kv-cache-memory", "8MiB",
            "--num-threads", "1", "--input-len", "8", "--output-len", "3", "--runs", "1", "--warmup", "0",
            "--no-roofline", "--quantization", "int4"]
    assert main(argv) == 0
    r = last_json(capsys)
    assert (r["quantization"], r["weight_format"]) == ("rtn", "int4")
    cost = ModelCost(load_arch_config(llama_dir), "float32", quantization="int4", lm_head_int8=True)
    assert r["loaded_weight_bytes"] == r["weight_bytes"] == cost.weight_bytes
