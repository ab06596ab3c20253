"""RMSNorm computed in float32, as the HF reference does; optionally fused with the residual add.
Gemma's (1 + weight) variant beside it.

With `ops` set (tokenmill's C++ CPU kernels, or the Triton ones) rows of its `fused_dtypes` take one fused
pass; everything else runs the reference torch code, which the fused op is tested against."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.ops: Any = None
        self.fused_dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,)  # the activations `ops` takes

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        """norm(x), or with a residual: (norm(x + residual), x + residual)."""
        if self.ops is not None and x.dtype in self.fused_dtypes and x.dim() == 2 and x.is_contiguous():
            if residual is None:
                return self.ops.rms_norm(x, self.weight, self.eps, None)
            return self.ops.rms_norm(x, self.weight, self.eps, residual), residual
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: scales by (1 + weight), in float32, and casts back after the scaling (where
    RMSNorm casts before it). The checkpoint stores the weight's offset from 1."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)
