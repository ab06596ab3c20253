"""MoE and MLA fields read from config.json: every family's field names and bad values refused with a
message (both config dialects: tests/models/test_config_dialects.py)."""

from __future__ import annotations

import json
import os

import pytest

from tokenmill.arch import parse_arch_config


def _cfg(model_dirs: dict[str, str], name: str) -> dict:
    with open(os.path.join(model_dirs[name], "config.json")) as f:
        return json.load(f)


def test_moe_fields_per_family(model_dirs: dict[str, str]) -> None:
    mixtral = parse_arch_config(_cfg(model_dirs, "mixtral-8x-top2")).moe
    assert mixtral is not None and (mixtral.num_experts, mixtral.top_k, mixtral.norm_topk_prob) == (8, 2, True)
    qwen2 = parse_arch_config(_cfg(model_dirs, "qwen2moe-shared"))
    assert qwen2.attention_bias and qwen2.moe is not None
    assert qwen2.moe.sparse_layers == (False, True)  # mlp_only_layers=[0]
    assert (qwen2.moe.shared_intermediate_size, qwen2.moe.shared_expert_gate) == (96, True)
    v2 = parse_arch_config(_cfg(model_dirs, "deepseek-v2-mla"))
    assert v2.moe is not None and v2.mla is not None
    assert v2.moe.sparse_layers == (False, True, True)  # first_k_dense_replace=1
    assert (v2.moe.topk_method, v2.moe.scoring, v2.moe.shared_intermediate_size) == ("group_limited_greedy",
                                                                                     "softmax", 2 * 32)
    assert v2.rope.rope_type == "yarn" and v2.rope.mscale_all_dim == pytest.approx(0.707)
    assert v2.kv_bytes_per_token == 3 * (32 + 16) and v2.head_dim == 32
    v3 = parse_arch_config(_cfg(model_dirs, "deepseek-v3-mla"))
    assert v3.moe is not None and (v3.moe.topk_method, v3.moe.scoring, v3.moe.score_correction_bias) == (
        "noaux_tc", "sigmoid", True)
    # moe_layer_freq (DeepSeek's own configs): every other layer from first_k_dense_replace on
    freq = parse_arch_config({**_cfg(model_dirs, "deepseek-v3-mla"), "num_hidden_layers": 5, "moe_layer_freq": 2})
    assert freq.moe is not None and freq.moe.sparse_layers == (False, False, True, False, True)


def test_bad_moe_fields_are_refused(model_dirs: dict[str, str]) -> None:
    v3 = _cfg(model_dirs, "deepseek-v3-mla")
    with pytest.raises(ValueError, match="topk_method 'best'"):
        parse_arch_config({**v3, "topk_method": "best"})
    with pytest.raises(ValueError, match="n_group 3"):
        parse_arch_config({**v3, "n_group": 3})
    with pytest.raises(ValueError, match="scoring_func"):
        parse_arch_config({**v3, "scoring_func": "relu"})
    with pytest.raises(ValueError, match="missing the field 'kv_lora_rank'"):
        parse_arch_config({k: v for k, v in v3.items() if k != "kv_lora_rank"})


def test_unsupported_architecture_lists_the_moe_families() -> None:
    with pytest.raises(ValueError, match="'GrokForCausalLM' is not supported; supported: .*DeepseekV3ForCausalLM"
                                         ".*MixtralForCausalLM.*Qwen2MoeForCausalLM"):
        parse_arch_config({"architectures": ["GrokForCausalLM"]})
