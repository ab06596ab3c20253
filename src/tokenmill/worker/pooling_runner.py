"""The pooling runner: embeddings, one vector per prompt, with no sampling and no engine core.

An encoder (a model with `is_pooling_model`, e.g. models/bert.py) runs over right-padded batches with
bidirectional attention and no KV cache; the prompts are sorted by length first so a batch pads little.
A decoder (the Llama family) runs each batch as one flat step of whole-prompt prefills through its
paged attention, over a scratch KV cache that holds one batch and is reused by the next. Either way
the final hidden states are pooled (layers/pooler.py) as the config's `PoolerConfig` says.

Batches hold at most `max_num_batched_tokens` tokens (padding counted) and `max_num_seqs` prompts;
a longer prompt runs alone."""

from __future__ import annotations

from typing import Any

import torch

from tokenmill.attention import get_backend
from tokenmill.attention.backend import AttentionMetadata
from tokenmill.config import EngineConfig, default_num_threads
from tokenmill.kernels import load_cpu_kernels
from tokenmill.layers import use_cpu_kernels
from tokenmill.layers.attention import attention_layers
from tokenmill.layers.linear import UnquantizedLinearMethod
from tokenmill.layers.pooler import finish, pool_flat, pool_padded
from tokenmill.models.loader import TORCH_DTYPES, load_model
from tokenmill.pooling import PoolerConfig


class PoolingRunner:
    def __init__(self, config: EngineConfig) -> None:
        if config.model.pooler is None:
            raise ValueError("the pooling runner needs a config made with runner='pooling'")
        self.config = config
        self.pooler: PoolerConfig = config.model.pooler
        self.device = torch.device(config.device.device)
        self.dtype = TORCH_DTYPES[config.model.dtype]
        if self.device.type == "cpu":
            torch.set_num_threads(config.device.num_threads or default_num_threads())
        use_ops = self.device.type == "cpu" and self.dtype == torch.bfloat16 and config.device.cpu_kernels
        ops: Any = load_cpu_kernels() if use_ops else None
        self.model: Any = load_model(config.model.model, config.model.arch, self.dtype, self.device,
                                     UnquantizedLinearMethod(ops))
        use_cpu_kernels(self.model, ops)
        self.is_encoder = bool(getattr(self.model, "is_pooling_model", False))
        self.block_size = config.cache.block_size
        self.backend = None if self.is_encoder else get_backend(config.attention_backend)
        self.num_cache_blocks = 0
        self.num_batches = 0  # model runs so far (one per batch)

    @property
    def hidden_size(self) -> int:
        return self.config.model.arch.hidden_size

    def batches(self, lengths: list[int]) -> list[list[int]]:
        """Indices of the prompts in each batch: by length (an encoder's batches are padded), at most
        max_num_batched_tokens tokens (padding counted) and max_num_seqs prompts a batch."""
        sched = self.config.scheduler
        order = sorted(range(len(lengths)), key=lambda i: lengths[i]) if self.is_encoder else range(len(lengths))
        out: list[list[int]] = []
        current: list[int] = []
        width = total = 0
        for i in order:
            n = lengths[i]
            cost = max(width, n) * (len(current) + 1) if self.is_encoder else total + n
            if current and (cost > sched.max_num_batched_tokens or len(current) >= sched.max_num_seqs):
                out.append(current)
                current, width, total = [], 0, 0
            current.append(i)
            width, total = max(width, n), total + n
        if current:
            out.append(current)
        return out

    @torch.inference_mode()
    def embed(self, prompts: list[list[int]], dimensions: list[int | None] | None = None) -> list[torch.Tensor]:
        """One float32 embedding per prompt (each non-empty), in their order; `dimensions[i]` truncates
        the i-th (Matryoshka), where given."""
        dims = dimensions or [None] * len(prompts)
        results: list[torch.Tensor | None] = [None] * len(prompts)
        for batch in self.batches([len(p) for p in prompts]):
            pooled = self._run([prompts[i] for i in batch])
            for row, i in enumerate(batch):
                results[i] = finish(pooled[row], self.pooler.normalize, dims[i]).cpu()
        return [r for r in results if r is not None]

    def _run(self, prompts: list[list[int]]) -> torch.Tensor:
        self.num_batches += 1
        lengths = [len(p) for p in prompts]
        if self.is_encoder:
            width = max(lengths)
            ids = torch.tensor([p + [0] * (width - len(p)) for p in prompts], device=self.device)
            lens = torch.tensor(lengths, device=self.device)
            hidden = self.model.encode(ids, lens).float()
            return pool_padded(hidden, lens, self.pooler.pooling_type)
        hidden = self._decoder_prefill(prompts).float()
        return pool_flat(hidden, lengths, self.pooler.pooling_type)

    def _decoder_prefill(self, prompts: list[list[int]]) -> torch.Tensor:
        """The decoder's final hidden states [T, H] for the prompts as one flat step of prefills from
        position 0, their K/V written to the scratch cache (block tables laid end to end)."""
        bs = self.block_size
        counts = [-(-len(p) // bs) for p in prompts]
        self._ensure_cache(sum(counts))
        tables: list[list[int]] = []
        slots: list[int] = []
        positions: list[int] = []
        starts = [0]
        first = 0
        for p, c in zip(prompts, counts, strict=True):
            tables.append(list(range(first, first + c)))
            slots += range(first * bs, first * bs + len(p))
            positions += range(len(p))
            starts.append(starts[-1] + len(p))
            first += c
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device), query_start_loc=starts,
            seq_lens=[len(p) for p in prompts], block_tables=tables, num_decodes=0, block_size=bs,
            sliding_window=self.config.model.arch.sliding_window)
        assert self.backend is not None
        self.backend.prepare(meta, self.device)
        ids = torch.tensor([t for p in prompts for t in p], device=self.device)
        hidden: torch.Tensor = self.model(ids, torch.tensor(positions, device=self.device), meta)
        return hidden

    def _ensure_cache(self, blocks: int) -> None:
        if blocks <= self.num_cache_blocks:
            return
        assert self.backend is not None
        for layer in attention_layers(self.model).values():
            cache = torch.zeros(2, blocks, self.block_size, layer.num_kv_heads, layer.head_dim, dtype=self.dtype,
                                device=self.device)
            layer.bind(cache, self.backend)
        self.num_cache_blocks = blocks
