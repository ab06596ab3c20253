from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from safetensors import safe_open

from tokenmill import config
from tokenmill.arch import load_arch_config, parse_arch_config
from tokenmill.bench import plan
from tokenmill.bench.model_math import ModelCost, decode_floor, kv_capacity, max_requests
from tokenmill.config import EngineArgs
from tokenmill.entrypoints.cli import main
from tokenmill.metrics.step_cost import model_cost

# hidden 64, 4 heads of 16 (2 KV heads), MLP 128, 2 layers, vocab 100. By hand:
#   embedding 100*64 = 6400; attention per layer 64*(64+2*32) + 64*64 = 12288; MLP 3*64*128 = 24576;
#   norms 2*64 = 128 -> layer 36992; params = 6400 + 2*36992 + 64 (final norm) + 6400 (lm_head) = 86848
#   matmul params (no embedding lookup) = 80448; KV = 2 (K,V) * 2 layers * 2 heads * 16 * 2 B = 256 B/token
CONFIG = dict(architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, vocab_size=100, max_position_embeddings=64,
              tie_word_embeddings=False, torch_dtype="bfloat16")


@pytest.fixture
def model_dir(tmp_path: Path) -> str:
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    return str(tmp_path)


def test_counts_by_hand() -> None:
    cost = ModelCost(parse_arch_config(CONFIG), "bfloat16")
    assert (cost.params, cost.matmul_params, cost.weight_bytes) == (86848, 80448, 173696)
    assert cost.kv_bytes_per_token == 256
    assert cost.decode_weight_bytes(1) == (80448 + 64) * 2  # lm_head in full, one embedding row
    tied = ModelCost(parse_arch_config({**CONFIG, "tie_word_embeddings": True}), "float32")
    assert (tied.params, tied.matmul_params, tied.decode_weight_bytes(8)) == (80448, 80448, 80448 * 4)
    # decode at batch 1, context 32: bytes = 161024 + 32*256; flops = 2*80448 + 4*2 layers*4 heads*16*32
    assert cost.decode_bytes(1, 32) == 169216 and cost.decode_flops(1, 32) == 177280
    f = decode_floor(cost, 1, 32, bandwidth_gbps=1.0, gflops=1.0)
    assert (f.memory_s, f.compute_s, f.bound) == (pytest.approx(169216e-9), pytest.approx(177280e-9), "compute")
    # positions 1, 2, 3 -> average 2; the lm_head runs once per prompt, not per token
    body = 80448 - cost.lm_head_params
    assert cost.prefill_flops_per_token(3) == 2 * body + 2 * cost.lm_head_params / 3 + 512 * 2
    # tied: the lm_head (the embedding table) also runs once per prompt, not once per token
    head = tied.embedding_params
    assert tied.prefill_flops_per_token(3) == 2 * (80448 - head) + 2 * head / 3 + 512 * 2
    # 64 KiB of KV in 16-token blocks of 4096 B: 16 blocks, 256 tokens, 4 requests of 64 tokens
    assert kv_capacity(65536, cost, 16) == 256 and max_requests(256, 64, 16) == 4 and max_requests(256, 65, 16) == 3


def test_a_request_costs_its_prefill_and_its_decode_steps() -> None:
    cost = ModelCost(parse_arch_config(CONFIG), "bfloat16")
    # prompt 5, output 4: a prefill of 5 (the first token), then decode steps at contexts 6, 7 and 8
    decodes = sum(cost.decode_flops(1, c) for c in (6, 7, 8))
    assert cost.request_flops(5, 4) == pytest.approx(5 * cost.prefill_flops_per_token(5) + decodes)
    assert cost.request_kv_bytes(5, 4) == (5 + 6 + 7 + 8) * 256
    assert cost.request_flops(5, 1) == pytest.approx(5 * cost.prefill_flops_per_token(5))
    assert cost.request_kv_bytes(5, 1) == 5 * 256


def test_crossover_batch_is_where_the_bound_flips() -> None:
    cost = ModelCost(parse_arch_config(CONFIG), "bfloat16")
    b = cost.crossover_batch(context=8, bandwidth_gbps=10.0, gflops=40.0)
    assert b is not None and b > 1
    assert decode_floor(cost, int(b), 8, 10.0, 40.0).bound == "memory"
    assert decode_floor(cost, int(b) + 1, 8, 10.0, 40.0).bound == "compute"
    assert cost.crossover_batch(context=10**6, bandwidth_gbps=10.0, gflops=40.0) is None  # KV-bound forever


def test_params_match_the_checkpoints(model_dirs: dict[str, str]) -> None:
    for name, d in model_dirs.items():
        numel = 0
        for f in os.listdir(d):
            if f.endswith(".safetensors"):
                with safe_open(os.path.join(d, f), "pt") as st:
                    numel += sum(_prod(st.get_slice(k).get_shape()) for k in st.keys())
        assert ModelCost(load_arch_config(d), "float32").params == numel, name


def _prod(shape: list[int]) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def test_plan_cli_json(model_dir: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plan, "cpu_runs_bf16", lambda: True)  # (a CPU with bf16 products: the model runs in bf16)
    assert main(["plan", model_dir, "--kv-cache-memory", "64KiB", "--bandwidth", "1", "--flops", "1",
                 "--context", "32", "--batch-sizes", "1,2,16", "--block-size", "16", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["block_size"] == 16
    assert (p["params"], p["weight_bytes"], p["kv_bytes_per_token"], p["max_kv_tokens"]) == (86848, 173696, 256, 256)
    assert (p["max_requests_at_max_model_len"], p["max_requests_at_context"]) == (4, 8)
    assert [r["batch"] for r in p["decode"]] == [1, 2, 16]
    assert p["decode"][0]["floor_ms"] == pytest.approx(177280e-6) and p["decode"][0]["bound"] == "compute"
    assert [r["fits"] for r in p["decode"]] == [True, True, False]  # 16 x 32 > 256 tokens
    assert p["bandwidth_source"] == "given" and p["dtype"] == "bfloat16"


def test_plan_follows_the_engine_on_a_cpu_without_bf16(model_dir: str, capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the engine's dtype auto runs a bf16 checkpoint in float32 over bf16-stored linear weights (an AVX2
    CPU, forced here), the plan counts the same weight and KV bytes as the engine's own ModelCost."""
    monkeypatch.setattr(plan, "cpu_runs_bf16", lambda: False)
    monkeypatch.setattr(config, "cpu_runs_bf16", lambda: False)
    assert main(["plan", model_dir, "--kv-cache-memory", "64KiB", "--bandwidth", "1", "--flops", "1", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    engine = model_cost(EngineArgs(model=model_dir, device="cpu").create_engine_config())
    assert (p["dtype"], p["linear_weight_dtype"]) == ("float32", "bfloat16")
    assert (p["weight_bytes"], p["kv_bytes_per_token"]) == (engine.weight_bytes, engine.kv_bytes_per_token)
    assert p["kv_bytes_per_token"] == 512 and p["weight_bytes"] < 86848 * 4  # float32 KV, bf16 projections
    assert main(["plan", model_dir, "--kv-cache-memory", "64KiB"]) == 0
    assert "linear weights stored bfloat16" in capsys.readouterr().out


def test_plan_cli_table_and_memory_split(model_dir: str, capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))  # nothing cached: no roofline figures
    assert main(["plan", model_dir, "--memory", "1MiB", "--dtype", "float32", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["kv_cache_bytes"] == 2**20 - 86848 * 4 and p["kv_bytes_per_token"] == 512
    assert p["mem_read_GBps"] is None and "floor_ms" not in p["decode"][0]
    assert p["block_size"] == 32  # the engine's CPU default
    assert main(["plan", model_dir]) == 0
    text = capsys.readouterr().out
    assert "86.8K" in text and "roofline     unknown" in text and "decode floor" in text
    assert main(["plan", model_dir, "--memory", "lots"]) == 2
    assert "--memory 'lots'" in capsys.readouterr().err
