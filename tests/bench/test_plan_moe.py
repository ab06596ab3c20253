"""`tokenmill plan` and the model math for mixture-of-experts and latent-attention checkpoints: MLA's
KV bytes per token are the latent plus the rope key, equal to what the engine's pool allocates per
token; MoE decode bytes count only the experts a step reads."""

from __future__ import annotations

import json

import pytest

from tokenmill import LLM
from tokenmill.arch import load_arch_config
from tokenmill.bench.latency import roofline_fields
from tokenmill.bench.model_math import ModelCost
from tokenmill.bench.roofline import Ceilings
from tokenmill.entrypoints.cli import main


def test_mla_plan_and_the_allocated_pool_agree(model_dirs: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    d = model_dirs["deepseek-v3-mla"]
    assert main(["plan", d, "--dtype", "float32", "--kv-cache-memory", "1MiB", "--block-size", "16",
                 "--bandwidth", "1", "--flops", "1", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    # 3 layers x (32 latent + 16 rope key) x 4 B; full K/V: 3 layers x 4 heads x (32 + 16) x 4 B
    assert plan["kv_layout"] == "mla"
    assert plan["kv_bytes_per_token"] == 3 * (32 + 16) * 4 == 576
    assert plan["full_kv_bytes_per_token"] == 3 * 4 * (32 + 16) * 4
    assert plan["kv_capacity_gain"] >= 4
    assert plan["max_kv_tokens"] == (1 << 20) // (576 * 16) * 16
    # the engine refuses a quantized latent cache, so plan offers none
    assert [r["kv_cache_dtype"] for r in plan["kv_cache_dtypes"]] == ["auto"]
    assert plan["kv_cache_dtypes"][0]["kv_bytes_per_token"] == 576
    llm = LLM(d, dtype="float32", kv_cache_memory="1MiB", block_size=16, skip_tokenizer_init=True)
    runner = llm.engine.core.executor.runner
    config = llm.engine.core.executor.kv_cache_config
    assert runner.kv_caches.nbytes == config.num_blocks * 16 * plan["kv_bytes_per_token"]
    assert config.num_blocks * 16 == plan["max_kv_tokens"]
    assert main(["plan", d, "--dtype", "float32", "--bandwidth", "1", "--flops", "1"]) == 0
    table = capsys.readouterr().out
    assert "MLA: 3 layers x (32 latent + 16 rope key)" in table and "4.0x the tokens" in table


def test_moe_decode_reads_only_the_chosen_experts(model_dirs: dict[str, str]) -> None:
    cost = ModelCost(load_arch_config(model_dirs["mixtral-8x-top2"]), "float32")
    expert = 3 * 64 * 128  # gate, up, down of one expert
    embedding = 512 * 64
    unread = 2 * (8 - 2) * expert  # 2 sparse layers, 6 of 8 experts idle at batch 1
    assert cost.expert_params == expert
    assert cost.matmul_params == cost.params - embedding - unread
    assert cost.decode_weight_bytes(1) == (cost.params - embedding - unread + 64) * 4
    # the routers stay float32 in a bfloat16 model (2 sparse layers x 8 experts x 64): 2 more bytes a weight
    bf16 = ModelCost(cost.arch, "bfloat16")
    assert bf16.decode_weight_bytes(1) == (cost.params - embedding - unread + 64) * 2 + 2 * 8 * 64 * 2
    assert bf16.weight_bytes == cost.params * 2 + 2 * 8 * 64 * 2
    # a large batch reads (nearly) every expert
    assert cost.experts_read(1) == 2 and cost.experts_read(256) == pytest.approx(8)
    assert cost.decode_weight_bytes(256) == pytest.approx((cost.params - embedding + 256 * 64) * 4, rel=1e-6)
    fields = roofline_fields(cost, Ceilings(10.0, 10.0, "given", "given"), 1, 100, 10, 1.0, 0.01)
    assert fields["experts_read_per_layer"] == 2
    assert fields["bytes_per_step"] == cost.decode_weight_bytes(1) + 100 * cost.kv_bytes_per_token
