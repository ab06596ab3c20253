"""Mixture-of-experts decoders on the Llama decoder: Mixtral, Qwen2-MoE (shared expert with a sigmoid
gate, qkv bias) and Qwen3-MoE (q/k RMSNorm). Attention, norms, rotary and loading are the Llama
family's; each sparse layer's MLP is a `layers.moe.SparseMoeBlock` (ArchConfig.moe says which layers
are sparse and how they route), the other layers keep the dense MLP. A model whose sparse blocks
route by softmax and greedy top-k with no shared expert (Mixtral) describes them to the fused decode
path (`describe_mlp`); the others keep the layer loop for decode.

Checkpoint layouts: per-expert tensors (`mlp.experts.N.gate_proj/up_proj/down_proj`, Mixtral's
`block_sparse_moe.experts.N.w1/w3/w2` and `block_sparse_moe.gate`) and transformers 5's fused
expert tensors (`mlp.experts.gate_up_proj` [E, 2 * I, hidden], `mlp.experts.down_proj`
[E, hidden, I]) both load into the same per-expert layers.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import cast

import torch
from torch import nn

from tokenmill.arch import ArchConfig
from tokenmill.layers.moe import ExpertMLP, SparseMoeBlock
from tokenmill.models.interface import DecoderLayerWeights, ModelOptions, RoutedExperts
from tokenmill.models.llama import DecoderLayer, LlamaForCausalLM

_MIXTRAL_EXPERT = re.compile(r"\.experts\.(\d+)\.w([123])\.")
_MIXTRAL_PROJ = {"1": "gate_proj", "2": "down_proj", "3": "up_proj"}


def expert_checkpoint_names(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint tensors with every MoE layout renamed to per-expert `mlp.experts.N.{gate,up,down}_proj`
    (fused expert tensors split per expert); other tensors pass unchanged."""
    for name, tensor in weights:
        name = name.replace(".block_sparse_moe.", ".mlp.")
        name = _MIXTRAL_EXPERT.sub(lambda m: f".experts.{m.group(1)}.{_MIXTRAL_PROJ[m.group(2)]}.", name)
        if name.endswith(".experts.gate_up_proj"):
            prefix = name.removesuffix("gate_up_proj")
            if tensor.dim() != 3 or tensor.shape[1] % 2:
                raise ValueError(f"checkpoint tensor {name!r}: expected [experts, 2 * intermediate, hidden], "
                                 f"got {list(tensor.shape)}")
            for e, fused in enumerate(tensor.unbind(0)):
                gate, up = fused.chunk(2, dim=0)
                yield f"{prefix}{e}.gate_proj.weight", gate
                yield f"{prefix}{e}.up_proj.weight", up
        elif name.endswith(".experts.down_proj"):
            prefix = name.removesuffix("down_proj")
            if tensor.dim() != 3:
                raise ValueError(f"checkpoint tensor {name!r}: expected [experts, hidden, intermediate], "
                                 f"got {list(tensor.shape)}")
            for e, down in enumerate(tensor.unbind(0)):
                yield f"{prefix}{e}.down_proj.weight", down
        else:
            yield name, tensor


class MoEDecoderLayer(DecoderLayer):
    def build_mlp(self, cfg: ArchConfig, opts: ModelOptions, layer_idx: int) -> nn.Module:
        moe = cfg.moe
        if moe is None or not moe.sparse_layers[layer_idx]:
            return super().build_mlp(cfg, opts, layer_idx)
        if cfg.hidden_act != "silu":
            raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported (only silu)")
        return SparseMoeBlock(moe, cfg.hidden_size, opts.dtype, opts.linear_method)


class MoEForCausalLM(LlamaForCausalLM):
    decoder_layer = MoEDecoderLayer

    def __init__(self, cfg: ArchConfig, opts: ModelOptions) -> None:
        if cfg.moe is None:
            raise ValueError(f"{cfg.architecture}: config.json describes no experts")
        super().__init__(cfg, opts)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(expert_checkpoint_names(weights))

    def describe_mlp(self, mlp: nn.Module, weights: DecoderLayerWeights) -> bool:
        """Dense layers as the Llama family's; a sparse block whose routing the fused decode kernel runs
        (softmax scores, greedy top-k, no shared expert, the fused grouped-by-expert path on) as
        `RoutedExperts`."""
        if not isinstance(mlp, SparseMoeBlock):
            return super().describe_mlp(mlp, weights)
        moe = mlp.cfg
        if (not mlp.fused or mlp.shared_expert is not None or moe.scoring != "softmax"
                or moe.topk_method != "greedy" or mlp.gate.e_score_correction_bias is not None):
            return False
        experts = cast(list[ExpertMLP], list(mlp.experts))
        weights.experts = RoutedExperts(mlp.gate.weight, [e.gate_up_proj for e in experts],
                                        [e.down_proj for e in experts], moe.top_k, moe.norm_topk_prob,
                                        moe.routed_scaling_factor)
        return True
