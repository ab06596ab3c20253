"""The attention backend protocol and the per-step batch description it is built from.

The model runner orders a step's sequences decodes first (query length 1), then prefill
chunks, and describes them once per step in `AttentionMetadata`; every layer reuses it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] long: cache slot of each new token
    query_start_loc: list[int]  # [B + 1] offsets of each sequence's tokens in the flat batch
    seq_lens: list[int]  # [B] context length after this step
    block_tables: list[list[int]]  # [B] physical block ids
    num_decodes: int  # sequences [0, num_decodes) have query length 1
    block_size: int
    # the attending layer's own: its window, and the tanh soft-capping of its scores (cap * tanh(s / cap));
    # the runner describes the step with neither and each PagedAttention sets its own (`for_layer`)
    sliding_window: int | None = None
    softcap: float | None = None
    extra: dict[str, torch.Tensor] = field(default_factory=dict)  # backend-specific tensors

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    def for_layer(self, sliding_window: int | None, softcap: float | None) -> AttentionMetadata:
        """This step as one layer attends: its window and soft-capping (the same per-step tensors)."""
        if sliding_window == self.sliding_window and softcap == self.softcap:
            return self
        return dataclasses.replace(self, sliding_window=sliding_window, softcap=softcap)


@dataclass
class OutputRows:
    """The rows of a step whose outputs are used (the rows it samples from), for the last layer.

    Every layer writes every row's keys and values to the cache, but only these rows need the last
    layer's attention output, its o_proj and MLP, and the final norm: in a prefill chunk that is one
    row at most, so the others' share of the last layer (its attention output, o_proj, MLP and final
    norm) is skipped. Each row attends as a single query at its own position over the same
    cache, so the rows are a step of decodes: `meta`, prepared by the backend like any step's."""

    index: torch.Tensor  # [R] long: flat-batch rows, in the order their outputs are wanted
    meta: AttentionMetadata


def output_rows(meta: AttentionMetadata, rows: list[int], seqs: list[int]) -> OutputRows:
    """rows[i], a query row of sequence seqs[i] of the step `meta` describes, as decodes."""
    index = torch.tensor(rows, dtype=torch.long, device=meta.slot_mapping.device)
    qsl, lens = meta.query_start_loc, meta.seq_lens
    # row r of sequence s sits at position lens[s] - (qsl[s + 1] - r); it sees the context up to it
    context = [lens[s] - (qsl[s + 1] - 1 - r) for r, s in zip(rows, seqs, strict=True)]
    rows_meta = AttentionMetadata(
        slot_mapping=meta.slot_mapping.index_select(0, index), query_start_loc=list(range(len(rows) + 1)),
        seq_lens=context, block_tables=[meta.block_tables[s] for s in seqs], num_decodes=len(rows),
        block_size=meta.block_size, sliding_window=meta.sliding_window, softcap=meta.softcap)
    return OutputRows(index, rows_meta)


def as_decode_rows(meta: AttentionMetadata) -> AttentionMetadata:
    """The same step with every query row a decode of its own, over its sequence's blocks up to its
    position: what the step computes is unchanged (each row attends causally as before), and a step of
    decodes and short verification runs (a token and its drafts) becomes one the decode kernels take."""
    qsl = meta.query_start_loc
    seqs = [s for s in range(meta.num_seqs) for _ in range(qsl[s + 1] - qsl[s])]
    return output_rows(meta, list(range(qsl[-1])), seqs).meta


@dataclass
class KVScales:
    """A quantized layer cache's scales (kv_cache_spec.QUANTIZED_KV_DTYPES): [num_blocks, block_size, Hk]
    float32 for K and for V; a cached value is element * scale."""

    k: torch.Tensor
    v: torch.Tensor


class AttentionBackend(Protocol):
    name: str
    # the quantized cache dtypes (torch dtype names) it writes and reads; float caches are always taken
    kv_cache_dtypes: tuple[str, ...]

    def prepare(self, meta: AttentionMetadata, device: torch.device) -> None:
        """Build the backend's per-step tensors into meta.extra (once per step, not per layer)."""

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, kv_scales: KVScales | None = None) -> None:
        """Store this step's keys and values at their slots (before any attention reads them); with
        `kv_scales`, quantized (attention/kv_quant.py's rule)."""

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hk, D] this step's keys (already written to the cache)
        v: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hk, D]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_scales: KVScales | None = None,  # a quantized cache's scales: attend to the dequantized values
    ) -> torch.Tensor:  # [T, Hq, D]
        ...


def check_kv_cache_dtype(backend: AttentionBackend, dtype: str) -> None:
    """Refuse, at start, a quantized cache dtype the backend does not read."""
    from tokenmill.kv_cache_spec import QUANTIZED_KV_DTYPES

    supported = getattr(backend, "kv_cache_dtypes", ())
    if dtype in QUANTIZED_KV_DTYPES and dtype not in supported:
        raise ValueError(f"attention backend {backend.name!r} does not support a {dtype} KV cache "
                         f"(it supports: {', '.join(supported) or 'none'}); use --kv-cache-dtype auto or "
                         "another --attention-backend")


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store this step's keys and values at their slots (before any attention reads them)."""
    # index_put_ over unique slots: faster than index_copy_ for decode-sized batches on CPU
    k_cache.view(-1, *k_cache.shape[2:]).index_put_((slot_mapping,), k)
    v_cache.view(-1, *v_cache.shape[2:]).index_put_((slot_mapping,), v)


def causal_mask(q_positions: torch.Tensor, k_len: int, window: int | None) -> torch.Tensor:
    """Bool [Tq, k_len]: True where query at q_positions[i] may see key position j."""
    k_pos = torch.arange(k_len, device=q_positions.device)
    mask = k_pos[None, :] <= q_positions[:, None]
    if window is not None:
        mask &= k_pos[None, :] > q_positions[:, None] - window
    return mask


def soft_cap(scores: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(scores / cap), as transformers' Gemma computes it; the scores as they are without a cap."""
    return scores if cap is None else torch.tanh(scores / cap) * cap


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`. To a GPU through pinned memory without blocking: a plain copy from pageable
    memory would wait for the kernels already queued (the step in flight), which the next step's inputs,
    prepared meanwhile, must not."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def padded_tables(tables: list[list[int]], width: int | None = None) -> torch.Tensor:
    """int32 [len(tables), width] (default: the longest table's): block tables right-padded with block 0,
    which no kernel reads past a sequence's length."""
    width = max((len(t) for t in tables), default=0) if width is None else width
    return torch.tensor([t[:width] + [0] * (width - len(t[:width])) for t in tables], dtype=torch.int32)


def gather_context(cache: torch.Tensor, block_ids: list[int], length: int) -> torch.Tensor:
    """[length, Hk, D]: the first `length` cached positions of a sequence (a copy)."""
    n_blocks = -(-length // cache.shape[1])
    idx = torch.tensor(block_ids[:n_blocks], device=cache.device)
    return cache.index_select(0, idx).flatten(0, 1)[:length]
