from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tokenmill.arch import load_arch_config
from tokenmill.bench import roofline
from tokenmill.bench.model_math import ModelCost
from tokenmill.entrypoints.cli import main

TINY = ["--gib", "0.004", "--n", "32", "--reps", "1"]  # sizes that measure nothing real, in milliseconds


@pytest.fixture(autouse=True)
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "roofline.json"


def last_json(capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_roofline_measures_once_then_reads_the_cache(own_cache: Path, capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    assert main(["bench", "roofline", "--threads", "1", *TINY]) == 0
    r = last_json(capsys)
    for key in roofline.FIELDS:  # a peak loop this CPU cannot run reads 0
        assert r[key] >= 0 and r["per_threads"]["1"][key] == r[key]
    assert r["mem_read_GBps"] > 0 and r["peak_bf16_gflops"] > 0 and r["peak_fp32_gflops"] > 0
    assert r["cached"] == {"1": False} and own_cache.is_file()

    def no_measuring(*args: Any, **kwargs: Any) -> dict[str, float]:
        raise AssertionError("measured again despite the cache")

    monkeypatch.setattr(roofline, "measure", no_measuring)
    assert main(["bench", "roofline", "--threads", "1", *TINY]) == 0
    again = last_json(capsys)
    assert again["cached"] == {"1": True} and again["mem_read_GBps"] == r["mem_read_GBps"]
    c = roofline.ceilings("float32")  # best cached thread count; fp32 picks the fp32 peak
    assert (c.bandwidth_gbps, c.gflops) == (r["mem_read_GBps"], r["peak_fp32_gflops"])
    assert c.bandwidth_source == "cache (threads=1): mem_read_GBps"
    assert roofline.ceilings("bfloat16", bandwidth=5.0).flops_source.endswith("peak_bf16_gflops")
    # each ceiling is the best of the ways it was measured
    assert r["mem_read_GBps"] == max(r["mem_read_stream_GBps"], r["mem_read_torch_GBps"], r["matvec_bf16_GBps"])
    assert r["peak_bf16_gflops"] == max(r["peak_bf16_avx512_gflops"], r["peak_bf16_amx_gflops"],
                                        r["matmul_bf16_gflops"])
    assert main(["bench", "roofline", "--threads", "0"]) == 2


def test_ceilings_without_cache_or_figures() -> None:
    c = roofline.ceilings("bfloat16")
    assert (c.bandwidth_gbps, c.gflops, c.bandwidth_source) == (None, None, "none")
    c = roofline.ceilings("bfloat16", bandwidth=12.5, flops=99.0)
    assert (c.bandwidth_gbps, c.gflops, c.flops_source) == (12.5, 99.0, "given")


@pytest.mark.parametrize("batch", [1, 3])
def test_latency_bench_on_the_tiny_model(llama_dir: str, batch: int, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "latency.json"
    argv = ["bench", "latency", "--model", llama_dir, "--dtype", "float32", "--kv-cache-memory", "8MiB",
            "--num-threads", "1", "--input-len", "12", "--output-len", "5", "--runs", "2",
            "--batch-size", str(batch), "--output-json", str(out)]
    argv += ["--bandwidth", "10", "--flops", "100"] if batch == 1 else ["--no-roofline"]
    assert main(argv) == 0
    r = last_json(capsys)
    assert json.loads(out.read_text())["prefill_s"] == r["prefill_s"]
    assert (r["bench"], r["batch_size"], r["prompt_len"], r["gen"], r["threads"]) == ("latency", batch, 12, 5, 1)
    assert isinstance(r["async_scheduling"], bool)  # the engine's choice, recorded
    assert len(r["prefill_s_runs"]) == len(r["decode_s_runs"]) == 2
    assert 0 < r["prefill_s"] < r["total_s"] and r["decode_s"] > 0
    assert r["decode_ms_per_tok"] == pytest.approx(r["decode_s"] / 4 * 1e3, rel=1e-2)
    assert r["decode_tok_s"] == pytest.approx(batch * 4 / r["decode_s"], rel=1e-2)
    assert r["prefill_tok_s"] == pytest.approx(batch * 12 / r["prefill_s"], rel=1e-2)
    cost = ModelCost(load_arch_config(llama_dir), "float32")
    assert r["params"] == cost.params and r["avg_context"] == 12 + 5 // 2
    assert r["bytes_per_step"] == cost.decode_weight_bytes(batch) + batch * 14 * cost.kv_bytes_per_token
    assert r["achieved_GBps"] == pytest.approx(r["bytes_per_step"] / (r["decode_ms_per_tok"] / 1e3) / 1e9, rel=0.02)
    assert r["prefill_flops"] == pytest.approx(batch * 12 * cost.prefill_flops_per_token(12), rel=1e-3)
    assert r["kv_capacity_tokens"] == r["kv_blocks"] * r["block_size"] and r["plan_kv_capacity_tokens"] > 0
    if batch == 1:  # never above 1: a rate above the ceiling raises it
        assert r["mbu"] == pytest.approx(min(1.0, r["achieved_GBps"] / 10), rel=0.02)
        assert r["mbu_ceiling_raised"] == (r["achieved_GBps"] > 10)
        assert r["prefill_mfu"] == pytest.approx(min(1.0, r["achieved_prefill_gflops"] / 100), rel=0.02)
        assert r["decode_memory_floor_ms"] == pytest.approx(r["bytes_per_step"] / 10e9 * 1e3, rel=1e-3)
        assert r["decode_floor_ms"] >= r["decode_memory_floor_ms"]
        assert r["bandwidth_source"] == "given" and r["prefill_from"] == "metrics"
        assert r["engine_GBps"] > 0 and 0 < r["engine_mbu"] <= 1 and 0 < r["engine_mfu"] <= 1
    else:
        assert r["mbu"] is None and r["prefill_mfu"] is None and r["bandwidth_source"] == "none"


def test_latency_rejects_bad_lengths(llama_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "latency", "--model", llama_dir, "--output-len", "1"]) == 2
    assert "--output-len" in capsys.readouterr().err
