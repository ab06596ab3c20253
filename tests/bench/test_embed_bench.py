"""`tokenmill bench embed` end to end on a tiny input count (both modes, with and without the
sentence-transformers baseline): what it counts and that both engines' embeddings agree."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenmill.entrypoints.cli import main


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_embed_bench_both_modes(bert_dir: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "embed.json"
    common = ["bench", "embed", "--model", bert_dir, "--num-threads", "1", "--num-prompts", "6", "--runs", "2",
              "--input-len", "8:40", "--max-num-batched-tokens", "128"]
    r = run([*common, "--concurrency", "3", "--output-json", str(out)], capsys)
    assert json.loads(out.read_text()) == r
    assert (r["bench"], r["mode"], r["prompts"], r["threads"], r["concurrency"]) == ("embed", "concurrent", 6, 1, 3)
    assert 6 * 8 <= r["prompt_tokens"] <= 6 * 40 and len(r["wall_s_runs"]) == len(r["st_wall_s_runs"]) == 2
    assert r["min_cosine_vs_st"] >= 0.9999 and r["speedup_vs_st"] > 0 and r["batches_per_run"] >= 1
    assert r["st_dtype"] == "float32"
    # both in bfloat16: the baseline's model cast to it, embeddings still close to each other
    bf16 = run([*common, "--concurrency", "3", "--dtype", "bfloat16", "--st-dtype", "bfloat16"], capsys)
    assert bf16["st_dtype"] == "bfloat16" and bf16["dtype"] == "bfloat16" and bf16["min_cosine_vs_st"] >= 0.99
    offline = run([*common, "--mode", "offline", "--no-baseline"], capsys)
    assert offline["mode"] == "offline" and "st_sentences_per_s" not in offline
    assert offline["prompt_tokens"] == r["prompt_tokens"]  # the same workload


def test_embed_bench_bad_arguments(bert_dir: str, llama_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "embed", "--model", bert_dir, "--concurrency", "0"]) == 2
    assert "--concurrency must be >= 1" in capsys.readouterr().err
