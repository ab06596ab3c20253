"""The MoE router against transformers' own routers (every family's rules), and the fused
grouped-by-expert path against the reference loop over experts."""

from __future__ import annotations

import pytest
import torch
import transformers

from tokenmill.arch_moe import MoEConfig
from tokenmill.layers.linear import UnquantizedLinearMethod
from tokenmill.layers.moe import SparseMoeBlock, route

HIDDEN = 32


def _hf_router(cls_name: str, cfg_cls: type, **fields: object) -> torch.nn.Module:
    module = {"Mixtral": transformers.models.mixtral.modeling_mixtral,
              "Qwen2Moe": transformers.models.qwen2_moe.modeling_qwen2_moe,
              "DeepseekV2": transformers.models.deepseek_v2.modeling_deepseek_v2,
              "DeepseekV3": transformers.models.deepseek_v3.modeling_deepseek_v3}[cls_name]
    router_cls = next(getattr(module, n) for n in dir(module) if n.lower() == f"{cls_name}TopKRouter".lower())
    router: torch.nn.Module = router_cls(cfg_cls(hidden_size=HIDDEN, **fields))
    with torch.no_grad():
        for p in list(router.parameters()) + list(router.buffers()):
            p.normal_(0.0, 0.3)
    return router


CASES = {
    "mixtral": ("Mixtral", transformers.MixtralConfig, dict(num_local_experts=8, num_experts_per_tok=2),
                MoEConfig(8, 2, 16, (True,), norm_topk_prob=True)),
    "qwen2moe": ("Qwen2Moe", transformers.Qwen2MoeConfig,
                 dict(num_experts=8, num_experts_per_tok=4, norm_topk_prob=False),
                 MoEConfig(8, 4, 16, (True,), norm_topk_prob=False)),
    "qwen2moe-norm": ("Qwen2Moe", transformers.Qwen2MoeConfig,
                      dict(num_experts=8, num_experts_per_tok=4, norm_topk_prob=True),
                      MoEConfig(8, 4, 16, (True,), norm_topk_prob=True)),
    "deepseek-v2-greedy": ("DeepseekV2", transformers.DeepseekV2Config,
                           dict(n_routed_experts=8, num_experts_per_tok=3, topk_method="greedy",
                                routed_scaling_factor=1.5),
                           MoEConfig(8, 3, 16, (True,), routed_scaling_factor=1.5)),
    "deepseek-v2-grouped": ("DeepseekV2", transformers.DeepseekV2Config,
                            dict(n_routed_experts=16, num_experts_per_tok=3, topk_method="group_limited_greedy",
                                 n_group=4, topk_group=2, routed_scaling_factor=16.0),
                            MoEConfig(16, 3, 16, (True,), topk_method="group_limited_greedy", n_group=4,
                                      topk_group=2, routed_scaling_factor=16.0)),
    "deepseek-v3-noaux": ("DeepseekV3", transformers.DeepseekV3Config,
                          dict(n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                               norm_topk_prob=True, routed_scaling_factor=2.5),
                          MoEConfig(16, 4, 16, (True,), scoring="sigmoid", norm_topk_prob=True,
                                    topk_method="noaux_tc", n_group=4, topk_group=2, routed_scaling_factor=2.5,
                                    score_correction_bias=True)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_router_matches_transformers(case: str) -> None:
    family, cfg_cls, fields, ours = CASES[case]
    torch.manual_seed(0)
    router = _hf_router(family, cfg_cls, **fields)
    x = torch.randn(64, HIDDEN)
    with torch.no_grad():
        _, hf_weights, hf_ids = router(x)
        bias = getattr(router, "e_score_correction_bias", None)
        weights, ids = route(torch.nn.functional.linear(x, router.weight), ours, bias)
    # the same experts with the same weights, whatever order top-k lists them in
    hf_order, our_order = hf_ids.argsort(dim=-1), ids.argsort(dim=-1)
    assert torch.equal(hf_ids.gather(1, hf_order), ids.gather(1, our_order))
    torch.testing.assert_close(hf_weights.float().gather(1, hf_order), weights.gather(1, our_order))


def _block(cfg: MoEConfig, dtype: torch.dtype) -> SparseMoeBlock:
    torch.manual_seed(1)
    with torch.device("cpu"):
        block = SparseMoeBlock(cfg, HIDDEN, dtype, UnquantizedLinearMethod(pack=False))
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn_like(p, dtype=torch.float32) * 0.3)
    return block


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_fused_path_equals_the_reference_loop(dtype: torch.dtype, tokens: int) -> None:
    cfg = MoEConfig(8, 2, 16, (True,), norm_topk_prob=True, shared_intermediate_size=24, shared_expert_gate=True)
    block = _block(cfg, dtype)
    x = torch.randn(tokens, HIDDEN, dtype=dtype)
    with torch.no_grad():
        fused = block(x)
        block.fused = False
        reference = block(x)
    assert torch.equal(fused, reference)


def test_a_batch_one_decode_reads_only_its_k_experts() -> None:
    cfg = MoEConfig(16, 2, 16, (True,), norm_topk_prob=True)
    block = _block(cfg, torch.float32)
    ran: list[int] = []
    for e, expert in enumerate(block.experts):
        expert.register_forward_hook(lambda *_, e=e: ran.append(e))
    x = torch.randn(1, HIDDEN)
    with torch.no_grad():
        _, ids = block.gate(x)
        block(x)
    assert sorted(ran) == sorted(ids[0].tolist()) and len(ran) == 2
    # a batch: each chosen expert runs once, over all of its tokens; no other expert runs
    ran.clear()
    x = torch.randn(5, HIDDEN)
    with torch.no_grad():
        _, ids = block.gate(x)
        block(x)
    assert ran == block.active_experts(ids) == sorted(set(ids.flatten().tolist()))
