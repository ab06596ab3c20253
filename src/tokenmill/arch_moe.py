"""The torch-free description of mixture-of-experts layers (`MoEConfig`) and of multi-head latent
attention (`MLAConfig`), read from a checkpoint's config.json for the families that have them:
Mixtral, Qwen2-MoE, Qwen3-MoE (experts) and DeepSeek V2 / V3 (experts and latent attention).

`arch.parse_arch_config` calls `parse_moe` and `parse_mla`; other families get None from both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


@dataclass(frozen=True)
class MoEConfig:
    """Routing and expert shapes. A layer is sparse where `sparse_layers[i]`; dense layers keep the
    model's `intermediate_size` MLP."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each routed expert's
    sparse_layers: tuple[bool, ...]
    scoring: str = "softmax"  # softmax | sigmoid: how router logits become scores
    norm_topk_prob: bool = False  # renormalise the k chosen scores to sum to 1
    topk_method: str = "greedy"  # greedy | group_limited_greedy | noaux_tc (DeepSeek's grouped top-k)
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    score_correction_bias: bool = False  # noaux_tc: a per-expert bias added to the scores for choice only
    shared_intermediate_size: int = 0  # 0: no shared expert
    shared_expert_gate: bool = False  # Qwen2-MoE: the shared expert's output scaled by sigmoid(x . w)

    @property
    def num_sparse_layers(self) -> int:
        return sum(self.sparse_layers)


@dataclass(frozen=True)
class MLAConfig:
    """DeepSeek's multi-head latent attention: queries through an optional low-rank projection
    (`q_lora_rank`), keys and values from one compressed latent of `kv_lora_rank` per token plus one
    rotary key of `qk_rope_head_dim` shared by all heads."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True  # rotary pairs are (x0, x1), (x2, x3), ... rather than two halves

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Elements one token keeps per layer in the KV cache."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def _int(cfg: dict[str, Any], *names: str, default: int | None = None) -> int:
    for name in names:
        if cfg.get(name) is not None:
            return int(cfg[name])
    if default is None:
        raise KeyError(names[0])
    return default


def parse_moe(cfg: dict[str, Any], arch: str) -> MoEConfig | None:
    """The MoE description of a config.json, or None for a dense family."""
    layers = int(cfg["num_hidden_layers"])
    if arch == "MixtralForCausalLM":
        return MoEConfig(num_experts=_int(cfg, "num_local_experts", "num_experts"),
                         top_k=_int(cfg, "num_experts_per_tok"), intermediate_size=int(cfg["intermediate_size"]),
                         sparse_layers=(True,) * layers,
                         norm_topk_prob=True)
    if arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        experts = _int(cfg, "num_experts", "num_local_experts")
        step = _int(cfg, "decoder_sparse_step", default=1)
        dense = set(cfg.get("mlp_only_layers") or [])
        sparse = tuple(i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(layers))
        shared = _int(cfg, "shared_expert_intermediate_size", default=0) if arch == "Qwen2MoeForCausalLM" else 0
        return MoEConfig(num_experts=experts, top_k=_int(cfg, "num_experts_per_tok"),
                         intermediate_size=_int(cfg, "moe_intermediate_size"), sparse_layers=sparse,
                         norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                         shared_intermediate_size=shared, shared_expert_gate=shared > 0)
    if arch in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"):
        v3 = arch == "DeepseekV3ForCausalLM"
        experts = _int(cfg, "n_routed_experts", "num_local_experts", "num_experts")
        first_dense = _int(cfg, "first_k_dense_replace", default=0)
        freq = _int(cfg, "moe_layer_freq", default=1)
        sparse = tuple(i >= first_dense and i % freq == 0 for i in range(layers))
        method = str(cfg.get("topk_method") or ("noaux_tc" if v3 else "greedy"))
        if method not in TOPK_METHODS:
            raise ValueError(f"topk_method {method!r} is not supported (supported: {', '.join(TOPK_METHODS)})")
        scoring = str(cfg.get("scoring_func") or ("sigmoid" if v3 else "softmax"))
        if scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"scoring_func {scoring!r} is not supported (supported: softmax, sigmoid)")
        n_group = _int(cfg, "n_group", default=1)
        topk_group = _int(cfg, "topk_group", default=n_group)
        if method != "greedy" and (n_group < 1 or experts % n_group or not 1 <= topk_group <= n_group):
            raise ValueError(f"n_group {n_group} / topk_group {topk_group} do not divide {experts} experts")
        moe_i = _int(cfg, "moe_intermediate_size")
        return MoEConfig(num_experts=experts, top_k=_int(cfg, "num_experts_per_tok"), intermediate_size=moe_i,
                         sparse_layers=sparse, scoring=scoring,
                         norm_topk_prob=bool(cfg.get("norm_topk_prob", v3)), topk_method=method,
                         n_group=n_group, topk_group=topk_group,
                         routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
                         score_correction_bias=method == "noaux_tc",
                         shared_intermediate_size=moe_i * _int(cfg, "n_shared_experts", default=0))
    return None


def parse_mla(cfg: dict[str, Any], arch: str) -> MLAConfig | None:
    if arch not in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"):
        return None
    q_lora = cfg.get("q_lora_rank")
    return MLAConfig(q_lora_rank=int(q_lora) if q_lora else None, kv_lora_rank=int(cfg["kv_lora_rank"]),
                     qk_nope_head_dim=int(cfg["qk_nope_head_dim"]), qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
                     v_head_dim=int(cfg["v_head_dim"]),
                     rope_interleave=arch == "DeepseekV2ForCausalLM" or bool(cfg.get("rope_interleave", True)))
