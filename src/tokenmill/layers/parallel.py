"""What a tensor-parallel rank holds of a layer, the vocabulary-parallel embedding, and the placeholder
of a module another pipeline stage holds.

A column-parallel linear (q/k/v, gate/up, lm_head) holds a slice of each fused part's output rows; a
row-parallel one (o_proj, down) a slice of the input columns, its partial products summed over the
ranks (`LinearBase.tp_reduce`). Each parameter's loader narrows the checkpoint tensor to the rank's
`CheckpointSlice` before copying, so a rank copies only its shard (with the loader's memory-mapped
files, only that shard is read)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.distributed import TensorParallel


@dataclass(frozen=True)
class CheckpointSlice:
    """`size` entries from `start` along `dim` of a checkpoint tensor (0: output rows, 1: input
    columns); entries past the tensor's end are zeros (a vocabulary padded to a multiple of the ranks).
    A tensor without that dimension (a row-parallel layer's bias) is taken whole."""

    dim: int
    start: int
    size: int

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dim() <= self.dim:
            return tensor
        length = tensor.shape[self.dim]
        part = tensor.narrow(self.dim, min(self.start, length), max(0, min(self.size, length - self.start)))
        missing = self.size - part.shape[self.dim]
        if missing:
            pad = [0, 0] * (tensor.dim() - 1 - self.dim) + [0, missing]
            part = F.pad(part, pad)
        return part


def equal_slice(total: int, tp: TensorParallel, dim: int = 0) -> CheckpointSlice:
    """This rank's 1/size of `total` entries (which must divide evenly)."""
    n = tp.split(total)
    return CheckpointSlice(dim, tp.rank * n, n)


def padded_slice(total: int, tp: TensorParallel) -> CheckpointSlice:
    """This rank's rows of a vocabulary padded up to a multiple of the ranks."""
    n = -(-total // tp.size)
    return CheckpointSlice(0, tp.rank * n, n)


class VocabParallelEmbedding(nn.Module):
    """The embedding table split by vocabulary rows (padded to a multiple of the ranks): each rank
    looks up the ids in its range, zeros for the others, and the ranks' rows are summed."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.rows = padded_slice(vocab_size, tp)
        self.weight = nn.Parameter(torch.empty(self.rows.size, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        part = self.rows.take(loaded)
        if tuple(part.shape) != tuple(param.shape):
            raise ValueError(f"tensor shape {list(loaded.shape)} does not give this rank's {list(param.shape)}")
        param.data.copy_(part)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.rows.start
        outside = (local < 0) | (local >= self.rows.size)
        h = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(h.masked_fill(outside.unsqueeze(-1), 0))


class PPMissingLayer(nn.Identity):
    """The place of a module another pipeline stage holds (a layer outside this stage's range, the
    embedding off the first stage, the final norm and lm_head off the last): no parameters, so the
    checkpoint's tensors for it find nothing to fill and the stage loads only its own."""
