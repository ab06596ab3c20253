"""A quantized KV cache in plain torch: int8 or fp8 e4m3 elements with one float32 scale per token and
kv head (value = element * scale), the scales in their own [num_blocks, block_size, Hk] tensors beside
the blocks. `quantize` is the one rounding rule (the C++ store, write_kv_quant_, matches it bit for bit);
the readers here dequantize a sequence's gathered context, never the whole cache."""

from __future__ import annotations

import torch

from tokenmill.attention.backend import KVScales, gather_context

QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (elements [..., D] of `dtype`, scales [...] float32): scale = amax / qmax (1 where
    amax is 0), element = x / scale rounded to nearest even (int8 clamped to +-127, fp8 to +-448)."""
    qmax = QMAX[dtype]
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    y = (xf / scale.unsqueeze(-1)).clamp(-qmax, qmax)
    q = y.round().to(dtype) if dtype == torch.int8 else y.to(dtype)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale.unsqueeze(-1)).to(dtype)


def write_kv_quantized(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       scales: KVScales, slot_mapping: torch.Tensor) -> None:
    """Quantize this step's keys and values [T, Hk, D] and store them and their scales at their slots."""
    for x, cache, sc in ((k, k_cache, scales.k), (v, v_cache, scales.v)):
        q, s = quantize(x, cache.dtype)
        # through uint8 views: index_put_ is not implemented for float8 on every device
        cache.view(torch.uint8).view(-1, *cache.shape[2:]).index_put_((slot_mapping,), q.view(torch.uint8))
        sc.view(-1, sc.shape[2]).index_put_((slot_mapping,), s)


def gather_dequantized(cache: torch.Tensor, scales: torch.Tensor, block_ids: list[int], length: int,
                       dtype: torch.dtype) -> torch.Tensor:
    """[length, Hk, D] in `dtype`: the first `length` cached positions of one sequence, dequantized."""
    q = gather_context(cache.view(torch.uint8), block_ids, length).view(cache.dtype)
    return dequantize(q, gather_context(scales, block_ids, length), dtype)


def select_dequantized(cache: torch.Tensor, scales: torch.Tensor, slots: torch.Tensor,
                       dtype: torch.dtype) -> torch.Tensor:
    """[len(slots), Hk, D] in `dtype`: the cached rows at flat slot indices, dequantized."""
    hk, dim = cache.shape[2:]
    q = cache.view(torch.uint8).view(-1, hk, dim).index_select(0, slots).view(cache.dtype)
    return dequantize(q, scales.view(-1, hk).index_select(0, slots), dtype)
