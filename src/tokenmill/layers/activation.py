"""SiLU-and-multiply over a fused gate/up projection's output, optionally by the C++ CPU kernel."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Any = None  # tokenmill's C++ CPU kernels, once use_cpu_kernels sets them

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up, gate and up the two halves of the last dimension."""
        if self.ops is not None and gate_up.dtype == torch.bfloat16:
            out: torch.Tensor = self.ops.silu_and_mul(gate_up)
            return out
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
