"""Fast attention paths, tested against torch_ref.

`SdpaBackend` (any device): all decodes of a step in one batched SDPA call over a single
gather of their context (GQA without repeating K/V: the query heads of a group become the
query length); prefill chunks with no earlier context attend to their own fresh K/V with no
cache read at all.

`CpuBackend`: decodes and (bf16, on CPUs with AVX512-BF16) all prefill chunks of a step read
K/V in place from the paged cache in C++ kernels (kernels/cpu/attention/paged_decode.cpp,
kernels/cpu/attention/prefill_attention.cpp), with no gather copy. Falls back to SDPA where a kernel cannot be
built or does not apply.

A quantized cache (int8 / fp8 e4m3 with per-token-head scales, attention/kv_quant.py): SDPA dequantizes
the context it gathers (decodes: one gather for all; prefill chunks: always from the cache, so that every
path attends to the same quantized values); `CpuBackend` quantizes in C++ (`write_kv_quant_`) and runs
the decodes and short prefill chunks' rows in one C++ call that reads the quantized cache in place
(kernels/cpu/attention/paged_decode_quant.cpp); longer chunks of bf16 rows through the C++ prefill kernel over
their context dequantized to bf16 (as a bf16 cache's chunks, where that kernel takes them), others through
SDPA's path.

Each layer attends with its own window (`AttentionMetadata.sliding_window`, set per layer); scores
soft-capped by tanh (`AttentionMetadata.softcap`, Gemma 2), which neither SDPA nor the C++ kernels do,
take the same arithmetic written out in float32 (`_attend_math`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from tokenmill.attention.backend import (
    AttentionMetadata,
    KVScales,
    causal_mask,
    gather_context,
    padded_tables,
    soft_cap,
    write_kv,
)
from tokenmill.attention.kv_quant import gather_dequantized, select_dequantized, write_kv_quantized
from tokenmill.kernels import load_cpu_kernels
from tokenmill.kv_cache_spec import QUANTIZED_KV_DTYPES

# SDPA kernels for CUDA: not cuDNN's, which builds a costly plan for each new shape, so that a first pass
# over prompts of many lengths would spend most of its time planning (bench/README.md, 'Measurements
# behind the code')
CUDA_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class SdpaBackend:
    name = "sdpa"
    kv_cache_dtypes = QUANTIZED_KV_DTYPES

    def prepare(self, meta: AttentionMetadata, device: torch.device) -> None:
        if meta.num_decodes:
            _prepare_gather(meta, device)

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, kv_scales: KVScales | None = None) -> None:
        if kv_scales is not None:
            write_kv_quantized(k, v, k_cache, v_cache, kv_scales, slot_mapping)
        else:
            write_kv(k, v, k_cache, v_cache, slot_mapping)

    def forward(self, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                kv_scales: KVScales | None = None) -> torch.Tensor:
        if q.is_cuda:
            with sdpa_kernel(CUDA_SDPA_BACKENDS):
                return self._attend(q, k_new, v_new, k_cache, v_cache, meta, scale, kv_scales)
        return self._attend(q, k_new, v_new, k_cache, v_cache, meta, scale, kv_scales)

    def _attend(self, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                kv_scales: KVScales | None) -> torch.Tensor:
        out = torch.empty_like(q)
        d = meta.num_decodes
        if d:
            out[:d] = self._decode(q[:d], k_cache, v_cache, meta, scale, kv_scales)
        for b in range(d, meta.num_seqs):
            s, e = meta.query_start_loc[b], meta.query_start_loc[b + 1]
            out[s:e] = self._prefill(q[s:e], k_new[s:e], v_new[s:e], k_cache, v_cache, meta, b, scale, kv_scales)
        return out

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, kv_scales: KVScales | None = None) -> torch.Tensor:
        d, hq, dim = q.shape
        hk = k_cache.shape[2]
        if "sdpa_index" not in meta.extra:  # a CpuBackend step whose layer needs this path
            _prepare_gather(meta, q.device)
        idx, mask = meta.extra["sdpa_index"], _decode_mask(meta)
        length = mask.shape[-1]
        if kv_scales is not None:
            k = select_dequantized(k_cache, kv_scales.k, idx, q.dtype).view(d, length, hk, dim).transpose(1, 2)
            v = select_dequantized(v_cache, kv_scales.v, idx, q.dtype).view(d, length, hk, dim).transpose(1, 2)
        else:
            k = k_cache.view(-1, hk, dim).index_select(0, idx).view(d, length, hk, dim).transpose(1, 2)
            v = v_cache.view(-1, hk, dim).index_select(0, idx).view(d, length, hk, dim).transpose(1, 2)
        qg = q.view(d, hk, hq // hk, dim)
        if meta.softcap is not None:
            o = _attend_math(qg, k, v, mask, scale, meta.softcap)
        else:
            o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
        return o.reshape(d, hq, dim)

    @staticmethod
    def _prefill(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, meta: AttentionMetadata, b: int, scale: float,
                 kv_scales: KVScales | None = None) -> torch.Tensor:
        n = q.shape[0]
        ctx = meta.seq_lens[b]
        window = meta.sliding_window
        qh = q.transpose(0, 1).unsqueeze(0)
        if kv_scales is None and ctx == n and (window is None or window >= n) and meta.softcap is None:
            k = k_new.transpose(0, 1).unsqueeze(0)
            v = v_new.transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            table = meta.block_tables[b]
            if kv_scales is not None:
                k = gather_dequantized(k_cache, kv_scales.k, table, ctx, q.dtype)
                v = gather_dequantized(v_cache, kv_scales.v, table, ctx, q.dtype)
            else:
                k, v = gather_context(k_cache, table, ctx), gather_context(v_cache, table, ctx)
            k, v = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
            mask = causal_mask(torch.arange(ctx - n, ctx, device=q.device), ctx, window)
            if meta.softcap is not None:
                group = q.shape[1] // k.shape[1]
                k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
                o = _attend_math(qh, k, v, mask, scale, meta.softcap)
            else:
                o = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        return o.squeeze(0).transpose(0, 1)


# the context from which SDPA's prefill outruns the C++ kernel's with AMX-BF16 (1.26-1.82x at 2,000
# positions, even to 0.84x at 512; bench/README.md, 'Measurements behind the code')
SDPA_PREFILL_MIN_CONTEXT = 1024
# over a quantized cache, the prefill chunk length from which the chunk's dequantized context goes to the C++
# prefill kernel or SDPA instead of the row kernel's one row at a time (bench/README.md, 'Measurements behind the
# code': measured against SDPA)
QUANT_SDPA_MIN_ROWS = 64


class CpuBackend(SdpaBackend):
    name = "cpu"

    def __init__(self) -> None:
        self.ops = load_cpu_kernels()
        self._prefill_dims: dict[int, bool] = {}
        # a step whose prefill reaches SDPA_PREFILL_MIN_CONTEXT positions runs its prefill chunks through SDPA
        # rather than the C++ kernel where this process may run AMX-BF16 but the kernel was built without its AMX
        # path (decided once a step, in prepare): torch's flash attention takes its tile products there, that
        # kernel VDPBF16PS (bench/README.md, 'Measurements behind the code'). With the kernel's AMX path
        # (`has_prefill_amx`) it takes every context (as fast as SDPA's at 1,000-2,000 positions, K/V read in
        # place). Decodes keep the C++ paged decode either way.
        self.prefill_amx = self.ops is not None and bool(self.ops.has_prefill_amx())
        self.sdpa_prefill = self.ops is not None and bool(self.ops.gemv_sees_amx_bf16()) and not self.prefill_amx

    def prepare(self, meta: AttentionMetadata, device: torch.device) -> None:
        d = meta.num_decodes
        if self.ops is None or device.type != "cpu":
            return super().prepare(meta, device)
        if d:
            meta.extra["decode_tables"] = padded_tables(meta.block_tables[:d])
            meta.extra["decode_lens"] = torch.tensor(meta.seq_lens[:d], dtype=torch.int32)
        if meta.num_seqs > d:
            if self.sdpa_prefill and max(meta.seq_lens[d:]) >= SDPA_PREFILL_MIN_CONTEXT:
                return  # no prefill tables: forward takes SDPA's path for the chunks, _decode the C++ kernel
            meta.extra["prefill_tables"] = padded_tables(meta.block_tables[d:])
            meta.extra["prefill_starts"] = torch.tensor(meta.query_start_loc[d:], dtype=torch.int32)
            meta.extra["prefill_lens"] = torch.tensor(meta.seq_lens[d:], dtype=torch.int32)

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, kv_scales: KVScales | None = None) -> None:
        if self.ops is None or k.device.type != "cpu":
            super().write_kv(k, v, k_cache, v_cache, slot_mapping, kv_scales)
        elif kv_scales is not None:
            self.ops.write_kv_quant_(k, v, k_cache, v_cache, kv_scales.k, kv_scales.v, slot_mapping)
        else:
            self.ops.write_kv_(k, v, k_cache, v_cache, slot_mapping)

    def decode_tables(self, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The padded block tables and context lengths of the step's decodes, as the C++ decode
        kernels read them; None where this step has no decode or they are not built."""
        tables = meta.extra.get("decode_tables")
        return None if tables is None else (tables, meta.extra["decode_lens"])

    def forward(self, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                kv_scales: KVScales | None = None) -> torch.Tensor:
        if meta.softcap is not None:  # the kernels do not soft-cap: the SDPA path's written-out arithmetic
            return SdpaBackend.forward(self, q, k_new, v_new, k_cache, v_cache, meta, scale, kv_scales)
        if kv_scales is not None:
            if self.ops is None or q.device.type != "cpu" or meta.num_seqs == 0:
                return super().forward(q, k_new, v_new, k_cache, v_cache, meta, scale, kv_scales)
            return self._forward_quantized(q, k_new, v_new, k_cache, v_cache, meta, scale, kv_scales)
        if "prefill_tables" not in meta.extra or not self._has_prefill_kernel(q):
            return super().forward(q, k_new, v_new, k_cache, v_cache, meta, scale)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # q may be a strided split of qkv
        d = meta.num_decodes
        if d:
            out[:d] = self._decode(q[:d], k_cache, v_cache, meta, scale)
        # all prefill chunks in one call, K/V read in place from the cache (kernels/cpu/attention/prefill_attention.cpp)
        self.ops.prefill_attention(q, k_cache, v_cache, meta.extra["prefill_tables"], meta.extra["prefill_starts"],
                                   meta.extra["prefill_lens"], scale, meta.sliding_window or 0, out, self.prefill_amx)
        return out

    def _forward_quantized(self, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                           kv_scales: KVScales) -> torch.Tensor:
        """A quantized cache: decodes and short chunks row by row in one C++ call that reads the cache in
        place; chunks of QUANT_SDPA_MIN_ROWS rows or more through SDPA over their dequantized context."""
        window = meta.sliding_window or 0
        chunks, rows = _quant_split(meta)
        if not chunks:
            tables, lens = _row_tables(meta)
            out: torch.Tensor = self.ops.paged_attention_quant(q, k_cache, v_cache, kv_scales.k, kv_scales.v, tables,
                                                                lens, scale, window)
            return out
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if rows is not None:
            out[rows] = self.ops.paged_attention_quant(q[rows], k_cache, v_cache, kv_scales.k, kv_scales.v,
                                                       meta.extra["quant_tables"], meta.extra["quant_lens"], scale,
                                                       window)
        qsl = meta.query_start_loc
        for b in chunks:
            s, e = qsl[b], qsl[b + 1]
            if self._dequantized_prefill(q, meta.seq_lens[b]):
                out[s:e] = self._prefill_dequantized(q[s:e], k_cache, v_cache, meta, b, scale, kv_scales)
            else:
                out[s:e] = self._prefill(q[s:e], k_new[s:e], v_new[s:e], k_cache, v_cache, meta, b, scale,
                                         kv_scales)
        return out

    def _dequantized_prefill(self, q: torch.Tensor, ctx: int) -> bool:
        """Whether a long chunk over a quantized cache takes the C++ prefill kernel over its dequantized context
        (bf16, the kernel built for the head size) rather than SDPA: where the step would take SDPA for a bf16
        cache too (`sdpa_prefill`, from SDPA_PREFILL_MIN_CONTEXT positions), SDPA."""
        if not self._has_prefill_kernel(q):
            return False
        return not (self.sdpa_prefill and ctx >= SDPA_PREFILL_MIN_CONTEXT)

    def _prefill_dequantized(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             meta: AttentionMetadata, b: int, scale: float, kv_scales: KVScales) -> torch.Tensor:
        """Chunk b's rows through the C++ prefill kernel, over its context dequantized to bf16 blocks of their
        own (the values SDPA's path attends to; the last block's rows past the context zero), K/V laid out as a
        cache of one sequence."""
        ctx, bs = meta.seq_lens[b], k_cache.shape[1]
        table = meta.block_tables[b]
        blocks = (ctx + bs - 1) // bs
        shape = (blocks, bs, *k_cache.shape[2:])
        k = gather_dequantized(k_cache, kv_scales.k, table, blocks * bs, q.dtype)  # the context's whole blocks
        v = gather_dequantized(v_cache, kv_scales.v, table, blocks * bs, q.dtype)
        k[ctx:] = 0
        v[ctx:] = 0
        out = torch.empty(q.shape, dtype=q.dtype)
        self.ops.prefill_attention(q, k.view(shape), v.view(shape), torch.arange(blocks, dtype=torch.int32)[None],
                                   torch.tensor([0, q.shape[0]], dtype=torch.int32),
                                   torch.tensor([ctx], dtype=torch.int32), scale, meta.sliding_window or 0, out,
                                   self.prefill_amx)
        return out

    def _has_prefill_kernel(self, q: torch.Tensor) -> bool:
        # the kernel is bf16-only (AVX512-BF16); other dtypes and CPUs keep the SDPA path
        if q.dtype != torch.bfloat16:
            return False
        dim = q.shape[-1]
        if dim not in self._prefill_dims:
            self._prefill_dims[dim] = bool(self.ops.has_prefill_kernel(dim))
        return self._prefill_dims[dim]

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, kv_scales: KVScales | None = None) -> torch.Tensor:
        if "decode_tables" not in meta.extra or kv_scales is not None or meta.softcap is not None:
            return super()._decode(q, k_cache, v_cache, meta, scale, kv_scales)
        return self.ops.paged_decode(q, k_cache, v_cache,
                                     meta.extra["decode_tables"], meta.extra["decode_lens"], scale,
                                     meta.sliding_window or 0)


def _row_tables(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Every query row of the step as a single query: its sequence's padded block table and the context
    it sees (a prefill row at position p sees p + 1 positions); built once per step, kept in meta.extra."""
    if "row_tables" not in meta.extra:
        qsl, lens = meta.query_start_loc, meta.seq_lens
        counts = [qsl[b + 1] - qsl[b] for b in range(meta.num_seqs)]
        meta.extra["row_tables"] = padded_tables(meta.block_tables).repeat_interleave(torch.tensor(counts), dim=0)
        meta.extra["row_lens"] = torch.cat([torch.arange(n - c + 1, n + 1, dtype=torch.int32)
                                            for n, c in zip(lens, counts, strict=True)])
    return meta.extra["row_tables"], meta.extra["row_lens"]


def _quant_split(meta: AttentionMetadata) -> tuple[list[int], torch.Tensor | None]:
    """Over a quantized cache: the prefill chunks (sequence indices) of QUANT_SDPA_MIN_ROWS query rows or
    more, and the query rows of everything else (None where there are none); where there are such chunks,
    those rows' block tables and context lengths (`quant_tables`, `quant_lens`). Built once per step."""
    if "quant_chunks" not in meta.extra:
        qsl = meta.query_start_loc
        chunks = [b for b in range(meta.num_decodes, meta.num_seqs) if qsl[b + 1] - qsl[b] >= QUANT_SDPA_MIN_ROWS]
        meta.extra["quant_chunks"] = torch.tensor(chunks, dtype=torch.int64)
        if chunks:
            keep = torch.ones(qsl[meta.num_seqs], dtype=torch.bool)
            for b in chunks:
                keep[qsl[b]:qsl[b + 1]] = False
            rows = keep.nonzero().flatten()
            tables, lens = _row_tables(meta)
            meta.extra["quant_rows"] = rows
            meta.extra["quant_tables"], meta.extra["quant_lens"] = tables[rows], lens[rows]
    kept = meta.extra.get("quant_rows")
    return meta.extra["quant_chunks"].tolist(), kept if kept is not None and kept.numel() else None


def _prepare_gather(meta: AttentionMetadata, device: torch.device) -> None:
    """The decodes' context gathered in one index (padded to the longest), and which of it each sees."""
    d = meta.num_decodes
    lens = torch.tensor(meta.seq_lens[:d], device=device)
    max_len = max(meta.seq_lens[:d])
    n_blocks = -(-max_len // meta.block_size)
    table = torch.tensor([bt[:n_blocks] + [0] * (n_blocks - len(bt[:n_blocks]))
                          for bt in meta.block_tables[:d]], device=device)
    offsets = torch.arange(meta.block_size, device=device)
    idx = (table[:, :, None] * meta.block_size + offsets).view(d, -1)[:, :max_len]
    pos = torch.arange(max_len, device=device)
    meta.extra["sdpa_index"] = idx.reshape(-1)
    meta.extra["sdpa_pos"] = pos
    meta.extra["sdpa_lens"] = lens
    meta.extra["sdpa_mask"] = (pos[None, :] < lens[:, None])[:, None, None, :]


def _decode_mask(meta: AttentionMetadata) -> torch.Tensor:
    """[d, 1, 1, L]: which gathered positions each decode sees, under the attending layer's window
    (built once per step and window; the layers of a step share meta.extra)."""
    window = meta.sliding_window
    if window is None:
        return meta.extra["sdpa_mask"]
    key = f"sdpa_mask_{window}"
    if key not in meta.extra:
        pos, lens = meta.extra["sdpa_pos"], meta.extra["sdpa_lens"]
        meta.extra[key] = meta.extra["sdpa_mask"] & (pos[None, :] >= (lens - window)[:, None])[:, None, None, :]
    return meta.extra[key]


def _attend_math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                 softcap: float) -> torch.Tensor:
    """Attention with soft-capped scores, in float32: q [..., Tq, D] against k/v [..., Tk, D] (heads
    matched), mask broadcast to the scores [..., Tq, Tk]."""
    scores = soft_cap(torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale, softcap)
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.matmul(probs, v.float()).to(q.dtype)
