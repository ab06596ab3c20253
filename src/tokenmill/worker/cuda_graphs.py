"""CUDA graphs for pure-decode steps (vLLM's decode CUDA graphs; `--enforce-eager` turns them off).

A decode step of n sequences is padded to the next capture size (1, 2, 4, then multiples of 8 up to
max_num_seqs) and replayed from a graph captured at start-up (every size, largest first, with every row
padded, before any step runs and so before another thread uses the GPU) over persistent input buffers:
token ids, positions, slots, block tables (as wide as max_model_len needs) and context lengths. Padded
rows have slot -1 (the Triton store writes nothing) and length 0 (they attend to nothing), so they touch
no request's cache. Prefill and mixed steps run eagerly.

Only the Triton backend's decode path reads nothing but those tensors and shapes, so graphs are made only
for it, and only for models whose forward has no data-dependent host work (no mixture-of-experts routing,
no MLA) and a float KV cache (the quantized store is torch's, which has no skipped slots)."""

from __future__ import annotations

import bisect
from typing import Any

import torch
from torch import nn

from tokenmill.attention.backend import AttentionBackend, AttentionMetadata
from tokenmill.layers.attention import attention_layers
from tokenmill.layers.mla import MLAAttention
from tokenmill.layers.moe import SparseMoeBlock


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The padded batch sizes graphs are captured for: 1, 2, 4, then multiples of 8, and max_num_seqs."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs] + list(range(8, max_num_seqs, 8))
    return sizes + [max_num_seqs]


def padded_size(n: int, sizes: list[int]) -> int | None:
    """The smallest capture size that holds n rows; None past the largest."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


def graphable(model: nn.Module, backend: AttentionBackend) -> bool:
    """Whether a decode step of this model and backend can be captured (see the module's docstring)."""
    if backend.name != "triton":
        return False
    if any(isinstance(m, (SparseMoeBlock, MLAAttention)) for m in model.modules()):
        return False
    return all(layer.kv_scales is None for layer in attention_layers(model).values())


class DecodeGraphs:
    def __init__(self, model: Any, max_num_seqs: int, max_model_len: int, block_size: int,
                 device: torch.device) -> None:
        self.model = model
        self.sizes = capture_sizes(max_num_seqs)
        self.block_size = block_size
        self.width = -(-max_model_len // block_size)
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slots = torch.full((n,), -1, dtype=torch.long, device=device)
        self.tables = torch.zeros(n, self.width, dtype=torch.int32, device=device)
        self.lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[Any, torch.Tensor]] = {}
        self.pool: Any = None  # one memory pool shared by every size's graph
        self.replays = 0  # decode steps run from a graph

    def capture_all(self) -> None:
        """Every size's graph, over buffers whose rows are all padding (nothing is written or read)."""
        for size in reversed(self.sizes):
            self.graphs[size] = self._capture(size)

    def applies(self, meta: AttentionMetadata, num_tokens: int) -> bool:
        return meta.num_decodes == meta.num_seqs == num_tokens and padded_size(num_tokens, self.sizes) is not None

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The step's hidden states [n, hidden], from the graph of its padded size (captured if new);
        valid until the next replay."""
        n = input_ids.shape[0]
        size = padded_size(n, self.sizes)
        assert size is not None
        self._fill(n, size, input_ids, positions, meta)
        if size not in self.graphs:  # (capture_all captures every size first)
            self.graphs[size] = self._capture(size)
        graph, hidden = self.graphs[size]
        graph.replay()
        self.replays += 1
        return hidden[:n]

    def _fill(self, n: int, size: int, input_ids: torch.Tensor, positions: torch.Tensor,
              meta: AttentionMetadata) -> None:
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slots[:n].copy_(meta.slot_mapping)
        # the backend's prepare put the step's tables (as wide as its longest context) and lengths on the
        # device already; columns past that width keep older blocks, which no row reads past its length
        tables = meta.extra["decode_tables"]
        self.tables[:n, :tables.shape[1]].copy_(tables)
        self.lens[:n].copy_(meta.extra["decode_lens"])
        self.positions[n:size].zero_()
        self.slots[n:size].fill_(-1)
        self.lens[n:size].zero_()

    def forward(self, size: int) -> torch.Tensor:
        """The model over the first `size` rows of the persistent buffers, as a graph records it: the
        attention metadata holds only those buffers (its host lists are placeholders nothing reads)."""
        meta = AttentionMetadata(slot_mapping=self.slots[:size], query_start_loc=list(range(size + 1)),
                                 seq_lens=[0] * size, block_tables=[[] for _ in range(size)], num_decodes=size,
                                 block_size=self.block_size)
        meta.extra["decode_tables"] = self.tables[:size]
        meta.extra["decode_lens"] = self.lens[:size]
        hidden: torch.Tensor = self.model(self.input_ids[:size], self.positions[:size], meta, None)
        return hidden

    def _capture(self, size: int) -> tuple[Any, torch.Tensor]:
        """(graph, its output) for this size; anything with replay() that refreshes the output will do."""
        self.forward(size)  # once eagerly: Triton compiles its kernels
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden = self.forward(size)
        self.pool = graph.pool()
        return graph, hidden
