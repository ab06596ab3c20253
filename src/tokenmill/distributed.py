"""This rank's place in the world of tensor_parallel_size x pipeline_parallel_size ranks, and the
communication the layers and the runner need.

The worker joins the world (torch.distributed over gloo on a CPU) and hands the model its
`TensorParallel` (the stage's ranks: the two collectives the layers need) and `PipelineParallel` (its
stage: which layers it holds, the hand-off of hidden states to the next stage, the sampled tokens sent
back from the last one) through `ModelOptions`; layers take them as arguments, never from a module
global. `TensorParallel()` and `PipelineParallel()` are the single rank (no communication), so every
layer runs the same code at any size. Ranks are laid out as vLLM's: a stage's tensor-parallel ranks are
consecutive, rank = stage * tp_size + tp_rank.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from tokenmill.parallel_config import pp_layer_range

# how long a collective waits for a peer before failing (a dead peer is seen sooner: its socket closes)
_COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=120)


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    # the stage's ranks' torch.distributed group; None: the default group (the world is this one stage)
    group: Any = field(default=None, compare=False)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's x (in place), e.g. a row-parallel layer's partial products."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x side by side along the last dimension, in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
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


# point-to-point tags: the hidden states a stage hands the next, the tokens the last stage shares back
_HIDDEN_TAG = 0
_TOKENS_TAG = 1


@dataclass(frozen=True)
class PipelineParallel:
    """This rank's pipeline stage: `stage` of `size`, each stage `tp_size` consecutive ranks. A stage
    receives the hidden states from the rank of the stage before that has its tensor-parallel rank, and
    sends its own to the same rank of the next stage; the last stage samples, and its first rank
    sends the sampled tokens to every rank of the earlier stages (whose request states need them).
    Sends return at once (gloo's isend; the caller keeps the returned handle, and with it the tensor,
    until it completes), so a stage goes on to its next step while the next stage takes the last."""

    stage: int = 0
    size: int = 1
    tp_rank: int = 0
    tp_size: int = 1

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.size - 1

    @property
    def rank(self) -> int:
        return self.stage * self.tp_size + self.tp_rank

    @property
    def output_rank(self) -> int:
        """The last stage's first rank: it answers the executor and shares the sampled tokens."""
        return (self.size - 1) * self.tp_size

    def layers(self, num_layers: int) -> range:
        """The indices of the layers this stage holds (parallel_config.pp_layer_range's split)."""
        return range(*pp_layer_range(num_layers, self.stage, self.size))

    def send(self, x: torch.Tensor) -> InFlight:
        """x to the next stage's rank."""
        x = x.contiguous()
        return InFlight(dist.isend(x, self.rank + self.tp_size, tag=_HIDDEN_TAG), x)

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The tensor the previous stage's rank sends (of this shape and dtype, which both sides know)."""
        x = torch.empty(shape, dtype=dtype)
        dist.recv(x, self.rank - self.tp_size, tag=_HIDDEN_TAG)
        return x

    def send_tokens(self, tokens: list[list[int]], capacity: list[int]) -> list[InFlight]:
        """On the output rank: each sampled row's tokens (row k at most capacity[k]) to every rank of the
        earlier stages, which take them with recv_tokens in the same order."""
        flat = torch.full((sum(capacity),), -1, dtype=torch.int64)
        at = 0
        for row, cap in zip(tokens, capacity, strict=True):
            flat[at:at + len(row)] = torch.tensor(row, dtype=torch.int64)
            at += cap
        return [InFlight(dist.isend(flat, rank, tag=_TOKENS_TAG), flat) for rank in range(self.output_rank)]

    def recv_tokens(self, capacity: list[int]) -> list[list[int]]:
        """On an earlier stage's rank: the next tokens the output rank sent (see send_tokens)."""
        flat = torch.empty((sum(capacity),), dtype=torch.int64)
        dist.recv(flat, self.output_rank, tag=_TOKENS_TAG)
        out: list[list[int]] = []
        at = 0
        for cap in capacity:
            part = flat[at:at + cap]
            out.append(part[part >= 0].tolist())
            at += cap
        return out


@dataclass
class InFlight:
    """A send not yet known to be complete, and the tensor it reads (kept alive until then)."""

    work: Any
    tensor: torch.Tensor

    def done(self) -> bool:
        return bool(self.work.is_completed())


def init_parallel(rank: int, tp_size: int, pp_size: int, init: str) -> tuple[TensorParallel, PipelineParallel]:
    """Join the gloo world of tp_size x pp_size ranks that rendezvous through `init`: a file path no other
    world uses (ranks on one machine), or a URL such as rank 0's `tcp://host:port` (ranks on several
    machines); this rank's TensorParallel and PipelineParallel."""
    world = tp_size * pp_size
    if world == 1:
        return TensorParallel(), PipelineParallel()
    init_method = init if "://" in init else f"file://{init}"
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                            timeout=_COLLECTIVE_TIMEOUT)
    stage, tp_rank = divmod(rank, tp_size)
    tp_group = None
    if pp_size > 1 and tp_size > 1:  # every rank creates every stage's group, in the same order
        for s in range(pp_size):
            group = dist.new_group(list(range(s * tp_size, (s + 1) * tp_size)), timeout=_COLLECTIVE_TIMEOUT)
            if s == stage:
                tp_group = group
    return TensorParallel(tp_rank, tp_size, tp_group), PipelineParallel(stage, pp_size, tp_rank, tp_size)


def close_tensor_parallel() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
