"""CPU bf16 linear layers with weights pre-packed once for oneDNN.

Plain `F.linear` on bf16 CPU tensors re-lays-out the weight on every call; for the small batches
of decode that costs more than the multiply itself (6-8x slower at batch 1 here). Packing at
load time gives the same numbers (bitwise, in bf16) at close to memory bandwidth. The plain
`nn.Linear` stays the reference path, and the one used for float32 and on CUDA.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)


class Linear(nn.Linear):
    """nn.Linear without random initialisation: every weight comes from the checkpoint, and init
    on the meta device pulls in ~1.5 s of torch._dynamo imports at start-up."""

    def reset_parameters(self) -> None:
        return None


class Embedding(nn.Embedding):
    """nn.Embedding without random initialisation (see Linear)."""

    def reset_parameters(self) -> None:
        return None


def packing_available() -> bool:
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # the layout chosen for batch 1 also runs large batches at full speed (measured)
        packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 1)
        self.weight = nn.Parameter(packed, requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


def pack_linears(model: nn.Module) -> int:
    """Swap every bf16 CPU nn.Linear in model for a PackedLinear; returns how many."""
    if not packing_available():
        logger.info("oneDNN weight packing unavailable; using plain linear layers")
        return 0
    # hold (parent, name) pairs, not the layers: each old weight must be freed as soon as its
    # packed copy exists, or peak memory doubles
    targets = [(parent, name) for parent in model.modules() for name, child in parent.named_children()
               if isinstance(child, nn.Linear) and child.weight.dtype == torch.bfloat16
               and child.weight.device.type == "cpu"]
    for parent, name in targets:
        setattr(parent, name, PackedLinear(getattr(parent, name)))
    return len(targets)
