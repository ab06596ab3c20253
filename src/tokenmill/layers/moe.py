"""Mixture-of-experts layers: the top-k router with each family's rules, the routed experts, and the
sparse MoE block (router, experts, optional shared expert) that replaces a decoder layer's MLP.

Routing (`route`): router logits in float32 become scores by softmax (Mixtral, Qwen, DeepSeek V2) or
sigmoid (DeepSeek V3); the k experts are chosen greedily, or within the best `topk_group` of `n_group`
expert groups (DeepSeek: `group_limited_greedy` ranks groups by their best score, `noaux_tc` by their
two best scores plus `e_score_correction_bias`, which only steers the choice); the chosen scores are
optionally renormalised to sum to 1 (`norm_topk_prob`; Mixtral always) and scaled by
`routed_scaling_factor`.

Each expert is a SiLU-gated MLP of `LinearBase` layers (its gate/up fused), so linear methods
(packing, quantization) apply to experts as to any projection. Two paths compute the routed
experts' sum, with the same arithmetic in the same order (per token, experts in ascending index):
- `fused` (default): the batch's (token, expert) pairs are sorted by expert once, and each expert
  that any token chose runs once over all of its tokens; experts nobody chose are not read, so a
  batch-1 decode reads only its k experts' weights;
- reference (`fused = False`): a loop over every expert, each finding its tokens by a mask.
The fused decode kernel (kernels/cpu/fused_decode) runs the `fused` path's ops in the same order in
C++ for the blocks a `DecoderLayout` describes as `RoutedExperts` (models/moe.py: Mixtral's).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.arch_moe import MoEConfig
from tokenmill.layers.activation import SiluAndMul
from tokenmill.layers.linear import Linear, LinearMethod, MergedLinear


def route(logits: torch.Tensor, cfg: MoEConfig,
          correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] float32, expert ids [T, k] long)."""
    logits = logits.float()
    scores = logits.sigmoid() if cfg.scoring == "sigmoid" else logits.softmax(dim=-1)
    t, e = scores.shape
    if cfg.topk_method == "greedy":
        weights, ids = torch.topk(scores, cfg.top_k, dim=-1)
    else:
        choice = scores if correction_bias is None else scores + correction_bias.float()
        grouped = choice.view(t, cfg.n_group, e // cfg.n_group)
        if cfg.topk_method == "noaux_tc":
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        else:  # group_limited_greedy
            group_scores = grouped.max(dim=-1).values
        groups = torch.topk(group_scores, cfg.topk_group, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
        keep = keep.unsqueeze(-1).expand(t, cfg.n_group, e // cfg.n_group).reshape(t, e)
        fill = float("-inf") if cfg.topk_method == "noaux_tc" else 0.0
        ids = torch.topk(choice.masked_fill(~keep, fill), cfg.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * cfg.routed_scaling_factor, ids


class TopKRouter(nn.Module):
    """The router's [E, hidden] weight (checkpoint: `...mlp.gate.weight`) and, for `noaux_tc`, its
    `e_score_correction_bias`, both kept in float32 whatever the model's dtype (as transformers keeps
    them), since a near tie between experts decides which ones run."""

    def __init__(self, cfg: MoEConfig, hidden: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, hidden, dtype=torch.float32), requires_grad=False)
        self.e_score_correction_bias = (nn.Parameter(torch.empty(cfg.num_experts, dtype=torch.float32),
                                                     requires_grad=False)
                                        if cfg.score_correction_bias else None)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight)
        return route(logits, self.cfg, self.e_score_correction_bias)


class ExpertMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); gate and up are shards 0 and 1 of `gate_up_proj`."""

    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype, method: LinearMethod) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden, [intermediate, intermediate], False, dtype, method)
        self.down_proj = Linear(intermediate, hidden, False, dtype, method)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class GateVector(nn.Module):
    """A [1, hidden] gate weight (Qwen2-MoE's `shared_expert_gate`)."""

    def __init__(self, hidden: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(1, hidden, dtype=dtype), requires_grad=False)


class SparseMoeBlock(nn.Module):
    """Router, routed experts and the optional shared expert (Qwen2-MoE: gated by
    sigmoid(shared_expert_gate . x); DeepSeek: added as is)."""

    def __init__(self, cfg: MoEConfig, hidden: int, dtype: torch.dtype, method: LinearMethod) -> None:
        super().__init__()
        self.cfg = cfg
        self.fused = True
        self.gate = TopKRouter(cfg, hidden)
        self.experts = nn.ModuleList(ExpertMLP(hidden, cfg.intermediate_size, dtype, method)
                                     for _ in range(cfg.num_experts))
        self.shared_expert = (ExpertMLP(hidden, cfg.shared_intermediate_size, dtype, method)
                              if cfg.shared_intermediate_size else None)
        self.shared_expert_gate = GateVector(hidden, dtype) if cfg.shared_expert_gate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = (self.routed(x, ids, weights) if self.fused else self.routed_reference(x, ids, weights))
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(F.linear(x, self.shared_expert_gate.weight)) * shared
            out = out + shared
        return out

    def active_experts(self, ids: torch.Tensor) -> list[int]:
        """The experts a step's routing chose, ascending: the only ones the fused path reads."""
        return torch.unique(ids).tolist()

    def routed(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The fused path: (token, expert) pairs grouped by expert; each chosen expert runs once."""
        k = ids.shape[1]
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        tokens = order // k
        pair_weights = weights.reshape(-1).index_select(0, order).to(x.dtype)
        counts = torch.bincount(flat, minlength=self.cfg.num_experts).tolist()
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            idx = tokens[start:start + n]
            y = self.experts[e](x.index_select(0, idx)) * pair_weights[start:start + n, None]
            out.index_add_(0, idx, y)
            start += n
        return out

    def routed_reference(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The reference path: every expert in turn, its tokens found by a mask."""
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            idx, slot = torch.where(ids == e)
            if idx.numel() == 0:
                continue
            y = expert(x[idx]) * weights[idx, slot, None].to(x.dtype)
            out.index_add_(0, idx, y)
        return out
