"""Multi-head latent attention over a latent KV cache (DeepSeek V2 / V3).

Per token the cache keeps only the normalised compressed latent c (kv_lora_rank) and the rotary key
k_pe (qk_rope_head_dim, shared by all heads): an `MLAAttentionSpec`, [blocks, block_size, r + d_rope].
Keys and values are c up-projected by kv_b_proj, whose rows are per head W_UK (qk_nope_head_dim rows)
then W_UV (v_head_dim rows):

    score(h, j) = scale * (q_nope[h] . W_UK[h] c_j + q_pe[h] . k_pe_j),   out[h] = sum_j p(h, j) W_UV[h] c_j

A decode (one query) takes the absorbed form: W_UK[h] is folded into the query (q_nope[h] W_UK[h], a
vector of r), the scores are dot products with the cached latents, the probabilities average the
latents, and W_UV[h] is applied once to that average; no per-position keys or values are built. A
prefill chunk (several queries over the same context) decompresses the context's keys and values
once and attends as standard causal attention does.
"""

from __future__ import annotations

import torch

from tokenmill.arch_moe import MLAConfig
from tokenmill.attention.backend import AttentionMetadata, OutputRows, causal_mask, gather_context
from tokenmill.kv_cache_spec import KVCacheSpec, MLAAttentionSpec
from tokenmill.layers.attention import PagedAttention


class MLAAttention(PagedAttention):
    """A paged attention layer whose cache is the latent one; its attention is computed here (torch),
    whichever attention backend the worker binds, since backends read K/V caches."""

    def __init__(self, num_heads: int, mla: MLAConfig, scale: float) -> None:
        super().__init__(num_heads, 1, mla.latent_dim, scale)
        self.mla = mla

    def kv_cache_spec(self, block_size: int, dtype: str) -> KVCacheSpec:
        return MLAAttentionSpec(block_size, dtype, self.mla.kv_lora_rank, self.mla.qk_rope_head_dim)

    def attend(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
               kv_b_weight: torch.Tensor, meta: AttentionMetadata, rows: OutputRows | None = None) -> torch.Tensor:
        """q_nope [T, H, d_nope], q_pe [T, H, d_rope] (rotated), latent [T, r] (normalised), k_pe
        [T, d_rope] (rotated), kv_b_weight [H * (d_nope + d_v), r]. Every row's latent goes to the
        cache; returns [T, H * d_v] for every row, or with `rows` for those rows only."""
        if self.backend is None:
            raise RuntimeError("MLAAttention used before the worker bound its KV cache")
        m, h = self.mla, self.num_heads
        cache = self.kv_cache  # [blocks, block_size, r + d_rope]
        cache.view(-1, cache.shape[-1]).index_put_((meta.slot_mapping,), torch.cat((latent, k_pe), dim=-1))
        if rows is not None:
            q_nope, q_pe = q_nope.index_select(0, rows.index), q_pe.index_select(0, rows.index)
            meta = rows.meta
        w = kv_b_weight.view(h, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        w_uk, w_uv = w[:, :m.qk_nope_head_dim], w[:, m.qk_nope_head_dim:]
        out = q_nope.new_empty(q_nope.shape[0], h, m.v_head_dim)
        nd, qsl = meta.num_decodes, meta.query_start_loc
        if nd:
            out[:nd] = self._decodes(q_nope[:nd], q_pe[:nd], meta, w_uk, w_uv)
        for s in range(nd, meta.num_seqs):
            a, b, length = qsl[s], qsl[s + 1], meta.seq_lens[s]
            context = gather_context(cache, meta.block_tables[s], length)  # [L, r + d_rope]
            c, kr = context[:, :m.kv_lora_rank], context[:, m.kv_lora_rank:]
            out[a:b] = self._prefill(q_nope[a:b], q_pe[a:b], c, kr, w_uk, w_uv, length)
        return out.reshape(out.shape[0], h * m.v_head_dim)

    def _decodes(self, q_nope: torch.Tensor, q_pe: torch.Tensor, meta: AttentionMetadata,
                 w_uk: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
        """The step's decodes (sequences [0, num_decodes), one query each) together in the absorbed
        form, their contexts gathered into one padded [B, L_max, r + d_rope] tensor (padding masked)."""
        r, cache, n = self.mla.kv_lora_rank, self.kv_cache, q_nope.shape[0]
        lens = meta.seq_lens[:n]
        blocks = -(-max(lens) // cache.shape[1])
        table = torch.tensor([(t[:blocks] + [0] * blocks)[:blocks] for t in meta.block_tables[:n]],
                             device=cache.device)
        context = cache[table].flatten(1, 2)[:, :max(lens)]  # [B, L_max, r + d_rope]
        c, kr = context[..., :r], context[..., r:]
        q_latent = torch.einsum("bhd,hdr->bhr", q_nope, w_uk)
        scores = (torch.einsum("bhr,blr->bhl", q_latent, c) + torch.einsum("bhd,bld->bhl", q_pe, kr)) * self.scale
        positions = torch.arange(context.shape[1], device=cache.device)
        valid = positions[None, :] < torch.tensor(lens, device=cache.device)[:, None]
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
        p = scores.float().softmax(dim=-1).to(c.dtype)
        return torch.einsum("bhr,hvr->bhv", torch.einsum("bhl,blr->bhr", p, c), w_uv)

    def _prefill(self, q_nope: torch.Tensor, q_pe: torch.Tensor, c: torch.Tensor, kr: torch.Tensor,
                 w_uk: torch.Tensor, w_uv: torch.Tensor, length: int) -> torch.Tensor:
        """Causal attention of n queries (the last n positions of the context) over decompressed keys
        and values: -> [n, H, d_v]."""
        n = q_nope.shape[0]
        k_nope = torch.einsum("lr,hdr->hld", c, w_uk)
        v = torch.einsum("lr,hvr->hlv", c, w_uv)
        scores = (torch.einsum("qhd,hld->hql", q_nope, k_nope) + torch.einsum("qhd,ld->hql", q_pe, kr)) * self.scale
        positions = torch.arange(length - n, length, device=c.device)
        scores = scores.masked_fill(~causal_mask(positions, length, None), float("-inf"))
        p = scores.float().softmax(dim=-1).to(c.dtype)
        return torch.einsum("hql,hlv->qhv", p, v)
