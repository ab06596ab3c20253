"""Pooling: one vector per sequence from a model's final hidden states (mean over its tokens, its
first token (CLS) or its last token), optionally normalised to unit length; then the `dimensions`
a request asks for (Matryoshka truncation, normalised again where the pooler normalises)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def pool_padded(hidden: torch.Tensor, lengths: torch.Tensor, pooling_type: str) -> torch.Tensor:
    """hidden [B, L, H] of right-padded sequences of `lengths` [B] -> [B, H]."""
    if pooling_type == "CLS":
        return hidden[:, 0]
    if pooling_type == "LAST":
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), lengths - 1]
    if pooling_type == "MEAN":
        mask = (torch.arange(hidden.shape[1], device=hidden.device)[None, :] < lengths[:, None]).to(hidden.dtype)
        return (hidden * mask[..., None]).sum(1) / lengths[:, None].to(hidden.dtype)
    raise ValueError(f"pooling type {pooling_type!r} is not supported")


def pool_flat(hidden: torch.Tensor, lengths: list[int], pooling_type: str) -> torch.Tensor:
    """hidden [T, H] of sequences of `lengths` one after another -> [B, H]."""
    if pooling_type == "MEAN":
        return torch.stack([seq.mean(0) for seq in hidden.split(lengths)])
    starts = torch.tensor([0, *lengths[:-1]], device=hidden.device).cumsum(0)
    if pooling_type == "CLS":
        return hidden.index_select(0, starts)
    if pooling_type == "LAST":
        return hidden.index_select(0, starts + torch.tensor(lengths, device=hidden.device) - 1)
    raise ValueError(f"pooling type {pooling_type!r} is not supported")


def finish(pooled: torch.Tensor, normalize: bool, dimensions: int | None = None) -> torch.Tensor:
    """Float32 embeddings, truncated to `dimensions` first, then normalised where asked."""
    out = pooled.float()
    if dimensions is not None:
        out = out[..., :dimensions]
    return F.normalize(out, dim=-1) if normalize else out
