"""The fused CPU decode path: a pure-decode step's whole layer loop in one C++ call
(kernels: `decode_layers`), or embedding, layers, lm_head and argmax in one (`decode_greedy`; with
structured output's token bitmask, the argmax over the allowed tokens). A layer's MLP is dense or
routed experts (Mixtral's block: the kernel routes and runs each chosen expert once over its rows,
as layers.moe.SparseMoeBlock's fused path does).

The runner builds it for a model that describes itself as a `DecoderLayout` (models/interface.py),
on the C++ CPU attention backend, when every projection is a packed bf16 weight that the GEMV takes, or
a quantized one (int8, int4, W8A8; routed experts unquantized only) that its method runs with the C++ kernels
(`fused_projection`); the
C++ calls run the same kernels in the same order as the Python layer loop with that backend, so they
give the same tokens. int8/int4 layers take the kernels up to `QuantizedLinearMethod.max_rows` rows
(KERNEL_MAX_ROWS, or AMX_MAX_ROWS where the ops run AMX-BF16; the torch reference beyond), so a model with
them is fused up to that many rows. It reads the backend's decode tables through
`CpuBackend.decode_tables`. A quantized KV cache (--kv-cache-dtype int8 / fp8_e4m3) is stored and read by
the ops the C++ backend calls for it (write_kv_quant_, paged_attention_quant), with each layer's scales.

A float32 model (an AVX2-only CPU's dtype auto) takes it too where its projections, routed experts' included, are
float (oneDNN-packed float32 weights, or bf16-stored ones: in bf16p_gemm's panels, or as loaded for the widening
GEMV and bf16w_gemm past its rows) and its cache float32: the kernels' float32 forms, as its Python loop calls
them.
"""

from __future__ import annotations

from typing import Any

import torch

from tokenmill.attention.backend import AttentionMetadata
from tokenmill.attention.cpu import CpuBackend
from tokenmill.layers.linear import LinearBase, PanelGemm, UnquantizedLinearMethod, WidenedGemv, embedding_rows
from tokenmill.layers.quantization import FUSED_KINDS, FusedProjection, fused_projection
from tokenmill.models.interface import DecoderLayerWeights, DecoderLayout, SupportsDecoderLayout
from tokenmill.worker.sampling_metadata import SamplingMetadata

ONEDNN_ONLY = -1  # the kernel's mark for a packed weight the GEMV does not read (oneDNN runs it)
WIDENED = -2  # the kernel's mark for a bf16-stored weight under float32 rows (the widening GEMV runs it)
PANELS = -3  # the kernel's mark for a bf16 weight in bf16p_gemm's panels under float32 rows (that product runs it)
BF16_STORED = (WIDENED, PANELS)


def _gemv_ptr(layer: LinearBase) -> int:
    """The GEMV's packed-weight address for an unquantized packed layer, ONEDNN_ONLY for one whose
    packed layout the GEMV does not read, WIDENED or PANELS for a bf16-stored one whose GEMV slot holds the
    widening GEMV or the panels' product, else 0."""
    if not isinstance(layer.method, UnquantizedLinearMethod):
        return 0
    if isinstance(layer.gemv_ops, WidenedGemv):
        return WIDENED
    if isinstance(layer.gemv_ops, PanelGemm):
        return PANELS
    ptr = layer.method.gemv_data_ptr(layer)
    return ptr if ptr or not layer.packed else ONEDNN_ONLY


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


def _float_fusable(layer: LinearBase) -> bool:
    """Whether the kernel runs this unquantized projection: a packed one (the GEMV or oneDNN) or a widened one.
    Routed experts must be one (the kernel quantizes none of them)."""
    ptr = _gemv_ptr(layer)
    return ptr in BF16_STORED or (layer.packed and ptr != 0)


def _fusable(layer: LinearBase, dtype: torch.dtype) -> bool:
    """Whether the kernel runs this projection for rows of `dtype` (quantized ones: bf16 rows only)."""
    return _float_fusable(layer) or (dtype == torch.bfloat16 and fused_projection(layer) is not None)


class FusedDecode:
    def __init__(self, layout: DecoderLayout, ops: Any, backend: CpuBackend) -> None:
        self.ops = ops
        self.backend = backend
        empty = layout.final_norm.new_empty(0)
        weights: list[torch.Tensor] = []
        expert_weights: list[torch.Tensor] = []  # per sparse layer: router, gate_ups, downs
        ptrs: list[int] = []
        quant: list[torch.Tensor] = []
        kinds: list[int] = []
        self.max_rows: int | None = None  # the most rows of a step it takes (None: any)
        for layer in layout.layers:
            bias = layer.qkv.bias if layer.qkv.bias is not None else empty
            # attention's projections, and a dense layer's MLP, may be quantized; routed experts are float
            # (create declines others). The kernel takes four quant/kind slots per layer: a sparse layer's
            # MLP slots are float ones.
            projections: list[LinearBase | None] = [layer.qkv, layer.o_proj, layer.gate_up, layer.down]
            fused = [fused_projection(m) if m is not None else None for m in projections]
            w = [f.weight if f is not None else m.weight if m is not None else empty
                 for m, f in zip(projections, fused, strict=True)]
            mlp: list[torch.Tensor]
            if layer.experts is None:
                assert layer.gate_up is not None and layer.down is not None
                mlp = [w[2], w[3]]
            else:  # empty slots mark a sparse layer
                mlp = [empty, empty]
                expert_weights += [layer.experts.router, *(m.weight for m in layer.experts.gate_up),
                                   *(m.weight for m in layer.experts.down)]
            weights += [layer.input_norm, w[0], bias, w[1], layer.post_norm, *mlp]
            ptrs += [_gemv_ptr(m) for m in _projections(layer)]
            for f in fused:
                quant += list(f.quant) if f is not None else [empty] * 4
                kinds += list(f.kind) if f is not None else [0, 0, 0]
                self._take_rows(f)
        self.gemv_ptrs = torch.tensor(ptrs, dtype=torch.int64)
        quantized = any(kinds)
        self.quant = quant if quantized else []
        self.linear_kinds = torch.tensor(kinds if quantized else [], dtype=torch.int64)
        self.kv_caches = [layer.kv_cache for layer in layout.layers]
        # a quantized cache's K and V scales per layer (empty: bf16 caches)
        self.kv_scales = [t for layer in layout.layers if layer.kv_scales is not None
                          for t in (layer.kv_scales.k, layer.kv_scales.v)]
        # what every call passes, gathered once: module attribute lookups cost more than the Python call
        self._static = (layout.cos, layout.sin, weights, self.gemv_ptrs, layout.final_norm)
        routing = _routing(layout)
        assert routing is not None
        self._dims = (layout.num_heads, layout.num_kv_heads, layout.head_dim, layout.rms_norm_eps, layout.scale,
                      layout.sliding_window or 0, True, self.quant, self.linear_kinds, self.kv_scales,
                      expert_weights, *routing)
        self.embed = layout.embed
        self.dtype = layout.cos.dtype  # the rows' (a bf16 embedding widens to float32 rows)
        lm_head = layout.lm_head
        # the lm_head's tensors as lm_head_greedy takes them: a packed or bf16-stored weight, or an int8 one (the
        # rounding methods' lm_head) with its scales and row sums
        self._lm_head: tuple[Any, ...] | None = None
        head = fused_projection(lm_head)
        if head is not None and head.kind[0] == FUSED_KINDS["int8"] and self.dtype == torch.bfloat16:
            self._lm_head = (head.weight, lm_head.bias, False, 0, head.quant[0], head.quant[1])
            self._take_rows(head)
        elif lm_head.packed or _gemv_ptr(lm_head) in BF16_STORED:
            self._lm_head = (lm_head.weight, lm_head.bias, lm_head.gemv_ops is not None, _gemv_ptr(lm_head), None,
                             None)

    def _take_rows(self, f: FusedProjection | None) -> None:
        if f is not None and f.max_rows is not None:
            self._take_max_rows(f.max_rows)

    def _take_max_rows(self, rows: int) -> None:
        self.max_rows = rows if self.max_rows is None else min(self.max_rows, rows)

    @classmethod
    def create(cls, model: Any, ops: Any, backend: Any) -> FusedDecode | None:
        """The fused path for this model on this backend (`ops`: the C++ kernels the model's layers take, bf16
        or float32), or None where it does not apply."""
        if ops is None or not isinstance(backend, CpuBackend) or backend.ops is None:
            return None
        if not isinstance(model, SupportsDecoderLayout):
            return None
        layout = model.decoder_layout()
        if layout is None or layout.cos.device.type != "cpu":
            return None
        dtype = layout.cos.dtype
        if dtype not in (torch.bfloat16, torch.float32):
            return None
        quantized_kv = [layer.kv_scales is not None for layer in layout.layers]
        if any(quantized_kv) and (not all(quantized_kv) or dtype != torch.bfloat16):
            return None
        if not any(quantized_kv) and any(layer.kv_cache.dtype != dtype for layer in layout.layers):
            return None
        if _routing(layout) is None:
            return None
        for layer in layout.layers:
            dense = [layer.qkv, layer.o_proj] + ([] if layer.experts is not None else _projections(layer)[2:])
            experts = _projections(layer)[2:] if layer.experts is not None else []
            if not all(_fusable(m, dtype) for m in dense) or not all(_float_fusable(m) for m in experts):
                return None
        return cls(layout, ops, backend)

    def applies(self, meta: AttentionMetadata, num_rows: int) -> bool:
        """Whether this step is one the fused call takes: pure decode, with the C++ decode tables, and no
        more rows than its quantized projections' kernels take."""
        if self.max_rows is not None and num_rows > self.max_rows:
            return False
        return meta.num_decodes == num_rows and self.backend.decode_tables(meta) is not None

    def _args(self, meta: AttentionMetadata) -> tuple[Any, ...]:
        tables = self.backend.decode_tables(meta)
        assert tables is not None
        return (*self._static, self.kv_caches, meta.slot_mapping, *tables, *self._dims)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The final hidden states of a pure-decode step (as the model's forward gives them)."""
        h = embedding_rows(self.embed, input_ids).to(self.dtype)
        out: torch.Tensor = self.ops.decode_layers(h, positions, *self._args(meta))
        return out

    def greedy(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
               bitmask: torch.Tensor | None = None, bitmask_ready: torch.Tensor | None = None) -> torch.Tensor | None:
        """Each row's argmax token of a pure-decode step whose rows are all plain greedy (over the tokens
        each row's bitmask allows, where one is given; with bitmask_ready, once that flag is set), or None where
        the lm_head is neither packed nor int8 (the caller takes the Python path then)."""
        if self._lm_head is None:
            return None
        ids: torch.Tensor = self.ops.decode_greedy(input_ids, self.embed, positions, *self._args(meta),
                                                   *self._lm_head, bitmask, bitmask_ready)
        return ids

    def greedy_awaiting(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                        sampling: SamplingMetadata, words: int) -> torch.Tensor | None:
        """greedy, for a step whose bitmasks (`words` int32 a row) are still being filled when it begins: one call
        that runs the layers and the lm_head, then waits (without the GIL) until the thread that fills them has
        written them into its bitmask, and takes the argmax over them. None where the lm_head is neither packed nor
        int8."""
        if self._lm_head is None:
            return None
        rows, ready = sampling.bitmask_written(words, self.ops.release_flag)
        ids = self.greedy(input_ids, positions, meta, rows, ready)
        sampling.take_written(rows)
        return ids

    def greedy_from_hidden(self, hidden: torch.Tensor, bitmask: torch.Tensor | None = None) -> torch.Tensor | None:
        """What greedy gives, from forward's hidden states: the lm_head and argmax in one call (for a step whose
        bitmasks were still being filled when it began), or None where the lm_head is neither packed nor int8."""
        if self._lm_head is None:
            return None
        ids: torch.Tensor = self.ops.lm_head_greedy(hidden, *self._lm_head, bitmask)
        return ids
