"""SiLU-and-multiply over a fused gate/up projection's output, optionally by the C++ CPU kernel, and
GELU-and-multiply (GeGLU) in torch."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Any = None  # tokenmill's C++ CPU kernels, once use_cpu_kernels sets them
        self.fused_dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,)  # the activations `ops` takes

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up, gate and up the two halves of the last dimension."""
        if self.ops is not None and gate_up.dtype in self.fused_dtypes:
            out: torch.Tensor = self.ops.silu_and_mul(gate_up)
            return out
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


GELU_APPROXIMATIONS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}  # hidden_act -> F.gelu's approximate


class GeluAndMul(nn.Module):
    """gelu(gate) * up over a fused gate/up projection's output (GeGLU, Gemma's MLP)."""

    def __init__(self, hidden_act: str) -> None:
        super().__init__()
        if hidden_act not in GELU_APPROXIMATIONS:
            raise ValueError(f"hidden_act {hidden_act!r} is not supported (supported: silu, "
                             f"{', '.join(GELU_APPROXIMATIONS)})")
        self.approximate = GELU_APPROXIMATIONS[hidden_act]

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate=self.approximate) * up
