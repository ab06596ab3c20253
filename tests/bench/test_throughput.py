"""`tokenmill bench throughput` end to end on a tiny checkpoint: what it counts and the estimates it derives."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tokenmill.arch import load_arch_config
from tokenmill.bench.model_math import ModelCost
from tokenmill.bench.roofline import kernel_peaks
from tokenmill.bench.workload import random_workload
from tokenmill.entrypoints.cli import main


@pytest.fixture(autouse=True)
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))  # no roofline cached


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_throughput_bench_counts_and_estimates(llama_dir: str, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "throughput.json"
    common = ["bench", "throughput", "--model", llama_dir, "--dtype", "float32", "--kv-cache-memory", "8MiB",
              "--num-threads", "1", "--num-prompts", "6", "--input-len", "8:40", "--output-len", "2:9",
              "--block-size", "16", "--no-detokenize"]
    r = run([*common, "--runs", "2", "--bandwidth", "10", "--flops", "100", "--output-json", str(out)], capsys)
    assert json.loads(out.read_text()) == r
    arch = load_arch_config(llama_dir)
    reqs = random_workload(6, "8:40", "2:9", 10, arch.vocab_size, 0)
    lens = [(len(q.prompt_token_ids), q.max_tokens) for q in reqs]
    assert (r["requests"], r["prompt_tokens"], r["output_tokens"]) == (6, sum(p for p, _ in lens),
                                                                        sum(o for _, o in lens))
    assert len(r["wall_s_runs"]) == len(r["steps_runs"]) == 2 and r["threads"] == 1
    # every request's prompt runs in one step (budget 2048), then one step per further output token
    assert r["steps_runs"] == [max(o for _, o in lens)] * 2 and r["steps"] == r["steps_runs"][0]
    # all six requests run at once, each holding the blocks its tokens so far fill
    assert r["kv_blocks_used_peak"] >= sum(math.ceil((p + o - 1) / 16) for p, o in lens)
    assert r["kv_blocks_used_peak"] <= r["kv_blocks"]
    cost = ModelCost(arch, "float32")
    flops = sum(cost.request_flops(p, o) for p, o in lens)
    nbytes = r["steps"] * cost.matmul_params * 4 + sum(cost.request_kv_bytes(p, o) for p, o in lens)
    assert (r["flops"], r["bytes"]) == (pytest.approx(flops, rel=1e-3), pytest.approx(nbytes, rel=1e-3))
    wall = flops / (r["achieved_gflops"] * 1e9)  # the unrounded median wall time, to 4 digits
    assert wall == pytest.approx(r["wall_s"], abs=5e-4 + 1e-3 * wall)  # wall_s is rounded to 1 ms
    assert r["achieved_GBps"] == pytest.approx(nbytes / wall / 1e9, rel=2e-3)
    assert r["mfu"] == pytest.approx(min(1.0, r["achieved_gflops"] / 100), rel=2e-3)
    assert r["mbu"] == pytest.approx(min(1.0, r["achieved_GBps"] / 10), rel=2e-3)
    assert r["mbu_ceiling_raised"] == (r["achieved_GBps"] > 10)
    assert (r["flops_source"], r["bandwidth_source"]) == ("given", "given")

    if max(kernel_peaks(1, 1).values(), default=0.0) > 0:  # a peak loop runs here: timed before and after the runs
        assert r["host_peak_gflops_before"] > 0 and r["host_peak_gflops_after"] > 0
    else:
        assert r["host_peak_gflops_before"] is r["host_peak_gflops_after"] is None

    bare = run([*common, "--runs", "1", "--no-roofline", "--no-host-probe"], capsys)  # nothing cached or measured
    assert (bare["mfu"], bare["mbu"], bare["flops_source"]) == (None, None, "none")
    assert bare["host_peak_gflops_before"] is bare["host_peak_gflops_after"] is None
    assert bare["achieved_gflops"] > 0


@pytest.mark.parametrize("flag", ["--runs", "--num-prompts"])
def test_throughput_bench_refuses_nothing_to_time(llama_dir: str, flag: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "throughput", "--model", llama_dir, flag, "0"]) == 2
    assert f"{flag} must be >= 1, got 0" in capsys.readouterr().err
