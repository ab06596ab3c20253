"""GPTQ (Frantar et al., 2022): quantize a weight's columns one at a time, each column's rounding error
spread over the columns not yet quantized through the inverse Hessian of the layer's inputs
(H = 2 X^T X over calibration tokens), so the layer's outputs on those inputs move least.

Quantization is q = clamp(round(w / scale) + zero, qmin, qmax), w ~ (q - zero) * scale; the caller's
`params` gives (scale, zero) per row for the columns of a group from their current (error-updated)
values, as GPTQ computes group parameters when it reaches the group.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Params = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def _inverse_hessian_factor(h: torch.Tensor, damp: float) -> torch.Tensor:
    """The upper Cholesky factor of H^-1, H damped by `damp` times its mean diagonal."""
    h = h.double().clone()
    idx = torch.arange(h.shape[0])
    h[idx, idx] += damp * float(h.diagonal().mean()) + 1e-8
    inv = torch.cholesky_inverse(torch.linalg.cholesky(h))
    return torch.linalg.cholesky(inv, upper=True).float()


@torch.no_grad()
def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, params: Params, group: int, qmin: int, qmax: int,
                  damp: float = 0.01, block: int = 128) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [N, K], hessian [K, K] -> (q [N, K] as floats, scale [N, G], zero [N, G]), G = ceil(K / group).
    Input columns the calibration never saw (zero Hessian diagonal) are quantized as they are."""
    w = weight.float().clone()
    n, k = w.shape
    h = hessian.float().clone()
    dead = h.diagonal() == 0
    h[dead, dead] = 1.0
    hinv = _inverse_hessian_factor(h, damp)
    block = max(block // group, 1) * group if group < k else block
    q = torch.zeros_like(w)
    scales, zeros = [], []
    scale = zero = torch.zeros(n)
    for b0 in range(0, k, block):
        b1 = min(b0 + block, k)
        w1, err = w[:, b0:b1].clone(), torch.zeros(n, b1 - b0)
        h1 = hinv[b0:b1, b0:b1]
        for i in range(b1 - b0):
            col = b0 + i
            if col % group == 0:
                end = min(col + group, k)
                cols = w1[:, i:i + end - col] if end <= b1 else torch.cat([w1[:, i:], w[:, b1:end]], dim=1)
                scale, zero = params(cols)
                scales.append(scale)
                zeros.append(zero)
            qc = torch.clamp(torch.round(w1[:, i] / scale) + zero, qmin, qmax)
            q[:, col] = qc
            e = (w1[:, i] - (qc - zero) * scale) / h1[i, i]
            w1[:, i:] -= e[:, None] * h1[i, i:][None, :]
            err[:, i] = e
        w[:, b1:] -= err @ hinv[b0:b1, b1:]
    return q, torch.stack(scales, dim=1), torch.stack(zeros, dim=1)


class HessianAccumulator:
    """H = 2 / n * sum x x^T over the n input rows seen, and each input column's largest |x|."""

    def __init__(self, in_features: int) -> None:
        self.h = torch.zeros(in_features, in_features, dtype=torch.float64)
        self.absmax = torch.zeros(in_features)
        self.rows = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).double()
        self.h += 2 * x.T @ x
        self.rows += x.shape[0]
        self.absmax = torch.maximum(self.absmax, x.abs().amax(dim=0).float())

    def hessian(self) -> torch.Tensor:
        return (self.h / max(self.rows, 1)).float()
