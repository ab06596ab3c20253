"""The Triton backend (kernels/triton/paged_attention.py): every row of a step reads K/V in place from the
paged cache, decodes in one flash-decoding launch (split over the context, GQA groups together), all
prefill chunks in another (cached prefixes and the chunk's own rows alike), sliding windows, soft-capped
scores and a quantized cache (int8 / fp8 e4m3, a float32 scale per token and kv head) in the kernels.

It runs on a CUDA GPU, and on the CPU only under Triton's interpreter (TRITON_INTERPRET=1, for tests).
The decode path reads only tensors (`decode_tables`, `decode_lens`, the slot mapping) and shapes, so a
CUDA graph captured over persistent copies of them replays it (worker/cuda_graphs.py)."""

from __future__ import annotations

import torch

from tokenmill.attention.backend import AttentionMetadata, KVScales, padded_tables, to_device
from tokenmill.attention.kv_quant import write_kv_quantized
from tokenmill.kernels.triton import paged_attention as pa
from tokenmill.kv_cache_spec import QUANTIZED_KV_DTYPES


class TritonBackend:
    name = "triton"
    kv_cache_dtypes = QUANTIZED_KV_DTYPES
    tile_n = 64  # key positions a tile

    def prepare(self, meta: AttentionMetadata, device: torch.device) -> None:
        d = meta.num_decodes
        if d:
            # the table is as wide as the longest context's blocks: its width sets the decode splits
            width = -(-max(meta.seq_lens[:d]) // meta.block_size)
            meta.extra["decode_tables"] = to_device(padded_tables(meta.block_tables[:d], width), device)
            meta.extra["decode_lens"] = to_device(torch.tensor(meta.seq_lens[:d], dtype=torch.int32), device)
        if meta.num_seqs > d:
            meta.extra["prefill_tables"] = to_device(padded_tables(meta.block_tables[d:]), device)
            meta.extra["prefill_lens"] = to_device(torch.tensor(meta.seq_lens[d:], dtype=torch.int32), device)
            meta.extra["prefill_starts"] = to_device(torch.tensor(meta.query_start_loc[d:], dtype=torch.int32), device)

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, kv_scales: KVScales | None = None) -> None:
        if kv_scales is not None:  # torch's store keeps kv_quant's rounding rule bit for bit
            write_kv_quantized(k, v, k_cache, v_cache, kv_scales, slot_mapping)
        else:
            pa.store_kv(k, v, k_cache, v_cache, slot_mapping)

    def forward(self, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                kv_scales: KVScales | None = None) -> torch.Tensor:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # q may be a strided split of qkv
        ks, vs = (kv_scales.k, kv_scales.v) if kv_scales is not None else (None, None)
        opts = dict(window=meta.sliding_window, softcap=meta.softcap, k_scales=ks, v_scales=vs, tile_n=self.tile_n)
        d = meta.num_decodes
        if d:
            pa.paged_decode(q[:d], k_cache, v_cache, meta.extra["decode_tables"], meta.extra["decode_lens"],
                            scale, out[:d], **opts)  # type: ignore[arg-type]
        if "prefill_tables" in meta.extra:
            block_q = pa.prefill_block_q(q.shape[1] // k_cache.shape[2])
            tile_seq, tile_q0 = self._tiles(meta, block_q, q.device)
            pa.paged_prefill(q, k_cache, v_cache, meta.extra["prefill_tables"], meta.extra["prefill_lens"],
                             meta.extra["prefill_starts"], tile_seq, tile_q0, scale, out, block_q=block_q,
                             **opts)  # type: ignore[arg-type]
        return out

    @staticmethod
    def _tiles(meta: AttentionMetadata, block_q: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's prefill query tiles, built by the first layer and kept in meta.extra for the others."""
        key = f"prefill_tiles_{block_q}"
        if key not in meta.extra:
            seqs, q0s = pa.prefill_tiles(meta.query_start_loc, meta.num_decodes, block_q)
            meta.extra[key] = to_device(torch.tensor([seqs, q0s], dtype=torch.int32), device)
        tiles = meta.extra[key]
        return tiles[0], tiles[1]
