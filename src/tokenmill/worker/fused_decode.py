"""The fused CPU decode path: a pure-decode step's whole layer loop in one C++ call
(kernels: `decode_layers`), or embedding, layers, lm_head and argmax in one (`decode_greedy`).
A layer's MLP is dense or routed experts (Mixtral's block: the kernel routes and runs each chosen
expert once over its rows, as layers.moe.SparseMoeBlock's fused path does).

The runner builds it for a model that describes itself as a `DecoderLayout` (models/interface.py),
on the C++ CPU attention backend, when every projection is a packed bf16 weight that the GEMV takes;
the C++ calls run the same kernels in the same order as the Python layer loop with that backend, so
they give the same tokens. It reads the backend's decode tables through `CpuBackend.decode_tables`.
It takes bf16 caches only: with a quantized KV cache (--kv-cache-dtype int8 / fp8_e4m3) it declines and
the Python layer loop runs, whose attention reads the quantized cache in C++.
"""

from __future__ import annotations

from typing import Any

import torch

from tokenmill.attention.backend import AttentionMetadata
from tokenmill.attention.cpu import CpuBackend
from tokenmill.layers.linear import LinearBase, UnquantizedLinearMethod
from tokenmill.models.interface import DecoderLayerWeights, DecoderLayout, SupportsDecoderLayout


def _gemv_ptr(layer: LinearBase) -> int:
    """The GEMV's packed-weight address for an unquantized packed layer, else 0."""
    if not isinstance(layer.method, UnquantizedLinearMethod):
        return 0
    return layer.method.gemv_data_ptr(layer)


def _projections(layer: DecoderLayerWeights) -> list[LinearBase]:
    """The layer's projections in the order the kernel takes their GEMV addresses: qkv, o, then the
    dense gate_up and down, or every expert's gate_up and then every expert's down."""
    if layer.experts is not None:
        return [layer.qkv, layer.o_proj, *layer.experts.gate_up, *layer.experts.down]
    assert layer.gate_up is not None and layer.down is not None
    return [layer.qkv, layer.o_proj, layer.gate_up, layer.down]


def _routing(layout: DecoderLayout) -> tuple[int, int, bool, float] | None:
    """(experts, top_k, norm_topk_prob, routed_scaling_factor) that every sparse layer of the layout
    shares (experts 0 where every layer is dense), or None where they differ (the kernel takes one)."""
    routing = {(len(r.gate_up), r.top_k, r.norm_topk_prob, r.routed_scaling_factor)
               for r in (layer.experts for layer in layout.layers) if r is not None}
    if len(routing) > 1:
        return None
    return routing.pop() if routing else (0, 0, False, 1.0)


class FusedDecode:
    def __init__(self, layout: DecoderLayout, ops: Any, backend: CpuBackend) -> None:
        self.ops = ops
        self.backend = backend
        empty = layout.final_norm.new_empty(0)
        weights: list[torch.Tensor] = []
        expert_weights: list[torch.Tensor] = []  # per sparse layer: router, gate_ups, downs
        ptrs: list[int] = []
        for layer in layout.layers:
            bias = layer.qkv.bias if layer.qkv.bias is not None else empty
            mlp: list[torch.Tensor]
            if layer.experts is None:
                assert layer.gate_up is not None and layer.down is not None
                mlp = [layer.gate_up.weight, layer.down.weight]
            else:  # empty slots mark a sparse layer
                mlp = [empty, empty]
                expert_weights += [layer.experts.router, *(m.weight for m in layer.experts.gate_up),
                                   *(m.weight for m in layer.experts.down)]
            weights += [layer.input_norm, layer.qkv.weight, bias, layer.o_proj.weight, layer.post_norm, *mlp]
            ptrs += [_gemv_ptr(m) for m in _projections(layer)]
        self.gemv_ptrs = torch.tensor(ptrs, dtype=torch.int64)
        self.kv_caches = [layer.kv_cache for layer in layout.layers]
        # what every call passes, gathered once: module attribute lookups cost more than the Python call
        self._static = (layout.cos, layout.sin, weights, self.gemv_ptrs, layout.final_norm)
        routing = _routing(layout)
        assert routing is not None
        self._dims = (layout.num_heads, layout.num_kv_heads, layout.head_dim, layout.rms_norm_eps, layout.scale,
                      layout.sliding_window or 0, True, expert_weights, *routing)
        self.embed = layout.embed
        lm_head = layout.lm_head
        self._lm_head: tuple[Any, ...] | None = None
        if lm_head.packed:
            self._lm_head = (lm_head.weight, lm_head.bias, lm_head.gemv_ops is not None, _gemv_ptr(lm_head))

    @classmethod
    def create(cls, model: Any, ops: Any, backend: Any) -> FusedDecode | None:
        """The fused path for this model on this backend, or None where it does not apply."""
        if ops is None or not isinstance(backend, CpuBackend) or backend.ops is None:
            return None
        if not isinstance(model, SupportsDecoderLayout):
            return None
        layout = model.decoder_layout()
        if layout is None or layout.cos.dtype != torch.bfloat16 or layout.cos.device.type != "cpu":
            return None
        if any(layer.kv_cache.dtype != torch.bfloat16 for layer in layout.layers) or _routing(layout) is None:
            return None
        for layer in layout.layers:
            if not all(m.packed and _gemv_ptr(m) for m in _projections(layer)):
                return None
        return cls(layout, ops, backend)

    def applies(self, meta: AttentionMetadata, num_rows: int) -> bool:
        """Whether this step is one the fused call takes: pure decode, with the C++ decode tables."""
        return meta.num_decodes == num_rows and self.backend.decode_tables(meta) is not None

    def _args(self, meta: AttentionMetadata) -> tuple[Any, ...]:
        tables = self.backend.decode_tables(meta)
        assert tables is not None
        return (*self._static, self.kv_caches, meta.slot_mapping, *tables, *self._dims)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The final hidden states of a pure-decode step (as the model's forward gives them)."""
        h = torch.nn.functional.embedding(input_ids, self.embed)
        out: torch.Tensor = self.ops.decode_layers(h, positions, *self._args(meta))
        return out

    def greedy(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """Each row's argmax token of a pure-decode step whose rows are all plain greedy, or None where
        the lm_head is not packed (the caller takes the Python path then)."""
        if self._lm_head is None:
            return None
        ids: torch.Tensor = self.ops.decode_greedy(input_ids, self.embed, positions, *self._args(meta),
                                                   *self._lm_head)
        return ids
