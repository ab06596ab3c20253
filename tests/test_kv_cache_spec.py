"""KV cache specs and the pool plan the engine core makes from them (torch-free)."""

from __future__ import annotations

import pytest

from tokenmill.kv_cache_spec import (
    FullAttentionSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    group_layers,
    plan_kv_cache,
)


def test_page_sizes() -> None:
    full = FullAttentionSpec(32, "bfloat16", num_kv_heads=4, head_size=64)
    assert full.bytes_per_token == 2 * 4 * 64 * 2 and full.page_size_bytes == 32 * 1024
    mla = MLAAttentionSpec(32, "bfloat16", kv_lora_rank=512, qk_rope_head_dim=64)
    assert mla.page_size_bytes == 32 * 576 * 2 and mla.block_shape() == (32, 576)
    # a DeepSeek-V2-Lite-sized latent against the same model's full K/V (16 heads of 192/128): > 4x smaller
    assert FullAttentionSpec(32, "bfloat16", 16, 192).bytes_per_token > 4 * mla.bytes_per_token


def test_plan_sizes_the_pool_from_every_layer() -> None:
    specs = {f"layers.{i}.attn": FullAttentionSpec(16, "float32", 2, 8) for i in range(3)}
    plan = plan_kv_cache(specs, budget_bytes=100_000)
    per_block = 3 * 16 * 2 * 2 * 8 * 4
    assert plan.bytes_per_block == per_block and plan.num_blocks == 100_000 // per_block
    assert len(plan.groups) == 1 and plan.groups[0].layer_names == tuple(specs)
    assert plan_kv_cache(specs, 100_000, num_blocks=7).num_blocks == 7
    assert plan_kv_cache(specs, 1).num_blocks == 1  # never an empty pool


def test_groups_by_spec_and_windows() -> None:
    full = FullAttentionSpec(16, "bfloat16", 2, 8)
    window = SlidingWindowSpec(16, "bfloat16", 2, 8, sliding_window=64)
    groups = group_layers({"a": full, "b": window, "c": full})
    assert [g.layer_names for g in groups] == [("a", "c"), ("b",)]
    # local and global layers (Gemma) in one plan: every layer keeps every block of the shared table
    mixed = plan_kv_cache({"a": full, "b": window, "c": full}, 10**6)
    assert [g.spec for g in mixed.groups] == [full, window]
    assert mixed.bytes_per_block == 3 * full.page_size_bytes == 3 * window.page_size_bytes


def test_bad_plans_are_refused() -> None:
    with pytest.raises(ValueError, match="no attention layer"):
        plan_kv_cache({}, 10**6)
    with pytest.raises(ValueError, match="same number of tokens"):
        plan_kv_cache({"a": FullAttentionSpec(16, "bfloat16", 2, 8), "b": FullAttentionSpec(32, "bfloat16", 2, 8)},
                      10**6)
