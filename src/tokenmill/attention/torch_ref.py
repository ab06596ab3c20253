"""The oracle: per sequence, gather the whole context from the paged cache and do the
attention arithmetic in plain torch (float32 softmax; sliding windows and soft-capped scores too).
Slow and obviously right. A quantized cache is read by dequantizing each sequence's gathered context
(attention/kv_quant.py)."""

from __future__ import annotations

import torch

from tokenmill.attention.backend import AttentionMetadata, KVScales, causal_mask, gather_context, soft_cap, write_kv
from tokenmill.attention.kv_quant import gather_dequantized, write_kv_quantized
from tokenmill.kv_cache_spec import QUANTIZED_KV_DTYPES


class TorchRefBackend:
    name = "torch_ref"
    kv_cache_dtypes = QUANTIZED_KV_DTYPES

    def prepare(self, meta: AttentionMetadata, device: torch.device) -> None:
        return None

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, kv_scales: KVScales | None = None) -> None:
        if kv_scales is not None:
            write_kv_quantized(k, v, k_cache, v_cache, kv_scales, slot_mapping)
        else:
            write_kv(k, v, k_cache, v_cache, slot_mapping)

    def forward(self, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                kv_scales: KVScales | None = None) -> torch.Tensor:
        out = torch.empty_like(q)
        group = q.shape[1] // k_cache.shape[2]
        for b in range(meta.num_seqs):
            start, end = meta.query_start_loc[b], meta.query_start_loc[b + 1]
            ctx = meta.seq_lens[b]
            if kv_scales is not None:
                k = gather_dequantized(k_cache, kv_scales.k, meta.block_tables[b], ctx, torch.float32)
                v = gather_dequantized(v_cache, kv_scales.v, meta.block_tables[b], ctx, torch.float32)
            else:
                k = gather_context(k_cache, meta.block_tables[b], ctx)
                v = gather_context(v_cache, meta.block_tables[b], ctx)
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            q_pos = torch.arange(ctx - (end - start), ctx, device=q.device)
            mask = causal_mask(q_pos, ctx, meta.sliding_window)
            scores = soft_cap(torch.einsum("qhd,khd->hqk", q[start:end].float(), k.float()) * scale, meta.softcap)
            scores = scores.masked_fill(~mask, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            out[start:end] = torch.einsum("hqk,khd->qhd", probs, v.float()).to(q.dtype)
        return out
