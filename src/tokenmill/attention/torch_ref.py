"""The oracle: per sequence, gather the whole context from the paged cache and do the
attention arithmetic in plain torch (float32 softmax; sliding windows and soft-capped scores too).
Slow and obviously right."""

from __future__ import annotations

import torch

from tokenmill.attention.backend import AttentionMetadata, causal_mask, gather_context, soft_cap, write_kv


class TorchRefBackend:
    name = "torch_ref"

    def prepare(self, meta: AttentionMetadata, device: torch.device) -> None:
        return None

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        write_kv(k, v, k_cache, v_cache, slot_mapping)

    def forward(self, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        out = torch.empty_like(q)
        group = q.shape[1] // k_cache.shape[2]
        for b in range(meta.num_seqs):
            start, end = meta.query_start_loc[b], meta.query_start_loc[b + 1]
            ctx = meta.seq_lens[b]
            k = gather_context(k_cache, meta.block_tables[b], ctx).repeat_interleave(group, dim=1)
            v = gather_context(v_cache, meta.block_tables[b], ctx).repeat_interleave(group, dim=1)
            q_pos = torch.arange(ctx - (end - start), ctx, device=q.device)
            mask = causal_mask(q_pos, ctx, meta.sliding_window)
            scores = soft_cap(torch.einsum("qhd,khd->hqk", q[start:end].float(), k.float()) * scale, meta.softcap)
            scores = scores.masked_fill(~mask, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            out[start:end] = torch.einsum("hqk,khd->qhd", probs, v.float()).to(q.dtype)
        return out
