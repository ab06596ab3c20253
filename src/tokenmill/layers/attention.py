"""The paged attention layer every model uses: it declares its KV cache spec, writes this step's keys
and values to its cache, and calls the attention backend. The worker binds each layer's cache tensor
(and a quantized cache's scales) and the backend once, after allocating the pool (`bind`); models never
touch caches or backends.

Each layer attends with its own sliding window and soft-capping of its scores (`softcap`, Gemma 2):
it hands the backend the step's metadata with its own set (`AttentionMetadata.for_layer`)."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.attention.backend import AttentionBackend, AttentionMetadata, KVScales, OutputRows
from tokenmill.kv_cache_spec import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None, softcap: float | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.softcap = softcap
        self.kv_cache = torch.empty(0)  # [2, num_blocks, block_size, num_kv_heads, head_dim] once bound
        self.kv_scales: KVScales | None = None  # a quantized cache's scales, [num_blocks, block_size, num_kv_heads]
        self.backend: AttentionBackend | None = None

    def kv_cache_spec(self, block_size: int, dtype: str) -> KVCacheSpec:
        if self.sliding_window is not None:
            return SlidingWindowSpec(block_size, dtype, self.num_kv_heads, self.head_dim, self.sliding_window)
        return FullAttentionSpec(block_size, dtype, self.num_kv_heads, self.head_dim)

    def bind(self, kv_cache: torch.Tensor, backend: AttentionBackend, kv_scales: torch.Tensor | None = None) -> None:
        """kv_cache [2, blocks, ...]; kv_scales [2, blocks, block_size, num_kv_heads] for a quantized one."""
        self.kv_cache = kv_cache
        self.kv_scales = None if kv_scales is None else KVScales(kv_scales[0], kv_scales[1])
        self.backend = backend

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                rows: OutputRows | None = None) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hk, D] (rotary applied). Every row's K/V go to the cache; the output
        [T, Hq * D] is every row's, or with `rows` only those rows' (in their order)."""
        backend = self.backend
        if backend is None:
            raise RuntimeError("PagedAttention used before the worker bound its KV cache")
        k_cache, v_cache = self.kv_cache[0], self.kv_cache[1]
        scales = self.kv_scales
        if scales is None:  # backends that take no quantized cache keep their signature
            backend.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        else:
            backend.write_kv(k, v, k_cache, v_cache, meta.slot_mapping, scales)
        if rows is not None:
            q, k, v = (y.index_select(0, rows.index) for y in (q, k, v))
            meta = rows.meta
        meta = meta.for_layer(self.sliding_window, self.softcap)
        if scales is None:
            o = backend.forward(q, k, v, k_cache, v_cache, meta, self.scale)
        else:
            o = backend.forward(q, k, v, k_cache, v_cache, meta, self.scale, scales)
        return o.reshape(q.shape[0], self.num_heads * self.head_dim)


def attention_layers(model: nn.Module) -> dict[str, PagedAttention]:
    """The model's paged attention layers by module name, in layer order."""
    return {name: m for name, m in model.named_modules() if isinstance(m, PagedAttention)}
