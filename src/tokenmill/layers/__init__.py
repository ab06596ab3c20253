"""The building blocks models are made of: linear layers with their LinearMethod, the paged attention
layer, norms, rotary embeddings and activations."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def use_cpu_kernels(model: nn.Module, ops: Any, dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,)) -> int:
    """Route the elementwise layers that have a fused path (norms, rotary, SiLU-and-mul) through `ops` for
    activations of `dtypes`: tokenmill's C++ CPU kernels (bfloat16 and float32), or on a GPU the Triton ones
    (kernels/triton/elementwise.py, the same signatures); None: the torch path. Returns how many layers take
    them."""
    from tokenmill.layers.activation import SiluAndMul
    from tokenmill.layers.norm import RMSNorm
    from tokenmill.layers.rotary import RotaryEmbedding

    layers = [m for m in model.modules() if isinstance(m, (RMSNorm, RotaryEmbedding, SiluAndMul))]
    for m in layers:
        m.ops = ops
        m.fused_dtypes = dtypes
    return len(layers)
