"""Tensor parallelism's group: this rank's place in it and the two collectives the layers need.

The worker creates it (torch.distributed over gloo on a CPU) and hands it to the model through
`ModelOptions.tp`; layers take it as an argument, never from a module global. `TensorParallel()` is
the single rank (no collectives), so every layer runs the same code at any size.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

# how long a collective waits for a peer before failing (a dead peer is seen sooner: its socket closes)
_COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=120)


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's x (in place), e.g. a row-parallel layer's partial products."""
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x side by side along the last dimension, in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    def split(self, total: int, what: str = "size") -> int:
        """This rank's share of `total` (heads, intermediate size), which must divide evenly."""
        if total % self.size:
            raise ValueError(f"{what} {total} is not divisible by the tensor parallel size {self.size}")
        return total // self.size

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """(this rank's first KV head, how many it holds): an equal share where the ranks do not
        outnumber the heads, else one head, replicated over size // num_kv_heads consecutive ranks
        (those whose query heads share it)."""
        if num_kv_heads >= self.size:
            n = self.split(num_kv_heads, "num_key_value_heads")
            return self.rank * n, n
        return self.rank * num_kv_heads // self.size, 1


def init_tensor_parallel(rank: int, size: int, init: str) -> TensorParallel:
    """Join the gloo group of `size` ranks that rendezvous through `init`: a file path no other group
    uses (ranks on one machine), or a URL such as rank 0's `tcp://host:port` (ranks on several
    machines); returns this rank's TensorParallel."""
    if size > 1:
        init_method = init if "://" in init else f"file://{init}"
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=size,
                                timeout=_COLLECTIVE_TIMEOUT)
    return TensorParallel(rank, size)


def close_tensor_parallel() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
