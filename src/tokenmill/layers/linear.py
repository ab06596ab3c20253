"""CPU bf16 linear layers with weights pre-packed once for oneDNN.

Plain `F.linear` on bf16 CPU tensors re-lays-out the weight on every call; for the small batches
of decode that costs more than the multiply itself (6-8x slower at batch 1 here). Packing at
load time gives the same numbers (bitwise, in bf16) at close to memory bandwidth. The plain
`nn.Linear` stays the reference path, and the one used for float32 and on CUDA.

tokenmill's own kernel (kernels/cpu/linear/gemv.cpp, "the GEMV") multiplies by the same packed weight: for decode's
1-4 rows it reads the weight 1.05-1.4x faster than oneDNN, and for more rows it prefetches the next
block of the weight while it works on one: 1.0-1.3x oneDNN's speed on the 100M model's shapes, one
thread, the most at 16-64 rows (tools/linear_bench.py). It relies on oneDNN's packed layout, so
`pack_linears` checks that layout once before turning it on.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)
GEMV_PROBE_ROWS = (1, 4, 13)  # the GEMV's paths: one row, its most rows without tiles, tiles of 6 and a tail


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
        self.gemv_ops: Any = None  # set by enable_gemv once the packed layout is verified
        self.gemv_max_rows = 0

    def enable_gemv(self, ops: Any) -> None:
        """Take ops.packed_gemv for as many rows as it is the faster kernel for (up to
        ops.packed_gemv_max_rows(in_features)), oneDNN beyond."""
        self.gemv_ops = ops
        self.gemv_max_rows = int(ops.packed_gemv_max_rows(self.in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemv_ops is not None and x.numel() <= self.gemv_max_rows * self.in_features:
            rows = x.reshape(-1, self.in_features).contiguous()
            y = self.gemv_ops.packed_gemv(rows, self.weight, self.bias)
            return y.view(*x.shape[:-1], self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")

    def gemv_data_ptr(self) -> int:
        """The packed weight's address, for C++ callers of the GEMV that skip the op's per-call lookup
        (valid while this module lives), or 0 where the GEMV does not take this weight."""
        if self.gemv_ops is None or not _is_ab16b64a2b(self.weight, self.out_features, self.in_features):
            return 0
        return int(torch.ops.mkldnn.data_ptr(self.weight))


@torch.no_grad()
def gemv_layout_ok(ops: Any) -> bool:
    """Whether ops.packed_gemv, which decodes oneDNN's packed layout itself, matches F.linear on
    this machine's oneDNN: awkward shapes (padding in N and K) and aligned ones, at GEMV_PROBE_ROWS."""
    gen = torch.Generator().manual_seed(0)
    for out_features, in_features in ((70, 33), (128, 64), (200, 96)):
        lin = Linear(in_features, out_features, dtype=torch.bfloat16)  # no init: leaves torch's RNG alone
        lin.weight.copy_(torch.randn(out_features, in_features, generator=gen))
        lin.bias.copy_(torch.randn(out_features, generator=gen))
        packed = PackedLinear(lin)
        if not _is_ab16b64a2b(packed.weight, out_features, in_features):
            return False
        for rows in GEMV_PROBE_ROWS:
            x = torch.randn(rows, in_features, generator=gen).to(torch.bfloat16)
            expected = F.linear(x.float(), lin.weight.float(), lin.bias.float())
            got = ops.packed_gemv(x, packed.weight, packed.bias).float()
            # bf16 output rounding is 2^-8 relative; a layout error is off by the outputs' own size
            if not torch.allclose(got, expected, rtol=2**-7, atol=1e-2 * float(expected.abs().max())):
                return False
    return True


def _is_ab16b64a2b(weight: torch.Tensor, out_features: int, in_features: int) -> bool:
    """Whether the packed buffer has the size of that layout (N padded to 64, K to 32). oneDNN picks
    other layouts elsewhere (an AMX Xeon pads N to 32), and the GEMV must not even be called then."""
    if not weight.is_mkldnn:
        return False
    padded = -(-out_features // 64) * 64 * -(-in_features // 32) * 32
    return int(torch.ops.mkldnn._nbytes(weight)) == padded * 2


def pack_linears(model: nn.Module, ops: Any = None) -> int:
    """Swap every bf16 CPU nn.Linear in model for a PackedLinear; returns how many. With ops (the
    C++ CPU kernels) the layers take their GEMV where it is faster, if it checks out."""
    if not packing_available():
        logger.info("oneDNN weight packing unavailable; using plain linear layers")
        return 0
    # hold (parent, name) pairs, not the layers: each old weight must be freed as soon as its
    # packed copy exists, or peak memory doubles
    targets = [(parent, name) for parent in model.modules() for name, child in parent.named_children()
               if isinstance(child, nn.Linear) and child.weight.dtype == torch.bfloat16
               and child.weight.device.type == "cpu"]
    gemv_ops = ops if ops is not None and _gemv_usable(ops) else None
    for parent, name in targets:
        packed = PackedLinear(getattr(parent, name))
        if gemv_ops is not None:
            packed.enable_gemv(gemv_ops)
        setattr(parent, name, packed)
    return len(targets)


def _gemv_usable(ops: Any) -> bool:
    if not ops.has_packed_gemv():
        logger.info("packed GEMV not built (no AVX512-BF16); using oneDNN")
        return False
    try:
        ok = gemv_layout_ok(ops)
    except RuntimeError as e:  # e.g. the packed buffer is not the size the layout implies
        logger.info("packed GEMV check failed (%s); using oneDNN", e)
        return False
    if not ok:
        logger.info("oneDNN's packed weight layout is not the one the GEMV reads; using oneDNN")
    return ok
