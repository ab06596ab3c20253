"""`tokenmill plan` and `tokenmill bench` with a quantized KV cache: the bytes per token they report are
the pool's, and the sequences of a given length that fit in the same KV budget."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenmill.bench import plan
from tokenmill.entrypoints.cli import main

# 4 layers of 2 kv heads of size 128 (the KV shape of common 1B-8B models): bf16 K+V = 2 x 2 heads x 128 x 2 B
# per layer; int8 / fp8 = 2 x 2 heads x (128 + 4) B (a float32 scale per token and kv head)
CONFIG = dict(architectures=["LlamaForCausalLM"], hidden_size=256, intermediate_size=512, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=128, vocab_size=100,
              max_position_embeddings=4096, tie_word_embeddings=True, torch_dtype="bfloat16")


@pytest.fixture
def model_dir(tmp_path: Path) -> str:
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    return str(tmp_path)


def test_plan_reports_each_kv_dtype(model_dir: str, capsys: pytest.CaptureFixture[str],
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plan, "cpu_runs_bf16", lambda: True)  # (a CPU with bf16 products: a bf16 KV cache)
    assert main(["plan", model_dir, "--kv-cache-memory", "1GiB", "--max-model-len", "2048", "--context", "2048",
                 "--bandwidth", "1", "--flops", "1", "--block-size", "16", "--kv-cache-dtype", "int8", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    by = {r["kv_cache_dtype"]: r for r in p["kv_cache_dtypes"]}
    bf16, int8, fp8 = by["auto"], by["int8"], by["fp8_e4m3"]
    assert (bf16["storage"], int8["storage"], fp8["storage"]) == ("bfloat16", "int8", "float8_e4m3fn")
    assert bf16["kv_bytes_per_token"] == 4 * 2 * 2 * 128 * 2 == 4096
    assert int8["kv_bytes_per_token"] == fp8["kv_bytes_per_token"] == 4 * 2 * 2 * (128 + 4) == 2112
    assert bf16["kv_blocks"] == (1 << 30) // (4096 * 16) and int8["kv_blocks"] == (1 << 30) // (2112 * 16)
    # 2048-token sequences in the same 1 GiB: 128 with bf16, 248 with int8 (x 1.94: the scales' 3%)
    assert (bf16["max_requests_at_context"], int8["max_requests_at_context"]) == (128, 248)
    # the plan's own figures follow --kv-cache-dtype
    assert p["kv_cache_dtype"] == "int8" and p["kv_bytes_per_token"] == 2112
    assert p["max_requests_at_context"] == 248


def test_plan_refuses_an_unknown_kv_dtype(model_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["plan", model_dir, "--kv-cache-dtype", "int4"])
    assert "invalid choice: 'int4'" in capsys.readouterr().err


def test_throughput_bench_with_an_int8_cache(llama_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    common = ["bench", "throughput", "--model", llama_dir, "--dtype", "float32", "--kv-cache-memory", "1MiB",
              "--num-threads", "1", "--num-prompts", "4", "--input-len", "40", "--output-len", "8",
              "--block-size", "16", "--no-detokenize", "--runs", "1", "--no-roofline"]
    rows = {}
    for kv in ("auto", "int8"):
        assert main([*common, "--kv-cache-dtype", kv]) == 0
        rows[kv] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    auto, int8 = rows["auto"], rows["int8"]
    # the tiny model: 2 layers x 2 kv heads x head size 16; float32 KV vs int8 plus its scales
    assert auto["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4 and int8["kv_bytes_per_token"] == 2 * 2 * 2 * (16 + 4)
    assert int8["kv_cache_dtype"] == "int8" and int8["kv_seq_len"] == 48
    for r in (auto, int8):
        assert r["kv_blocks"] == (1 << 20) // (16 * r["kv_bytes_per_token"])
        assert r["kv_seqs_fit"] == r["kv_blocks"] // 3
    assert int8["output_tokens"] == auto["output_tokens"] == 32
