"""Linear layers whose weights are created, loaded, post-processed and applied by a `LinearMethod`.

A layer knows its shape and how checkpoint tensors map onto its parameters (`weight_loader`, with a
shard id for the fused qkv and gate/up projections); the method decides what the parameters are and
how they multiply. `UnquantizedLinearMethod` is the plain float path: on a bf16 CPU it packs each
weight once for oneDNN after loading (plain `F.linear` on bf16 CPU tensors re-lays-out the weight on
every call), and where tokenmill's C++ kernels are built it multiplies decode-sized batches with their
GEMV over the same packed weight (kernels/: `packed_gemv`). On a GPU the same slot
(`LinearBase.gemv_ops`) holds the Triton GEMV for one-row batches, over the plain weight
(`use_triton_gemv`). Quantized methods (int8/int4, GPTQ, AWQ)
create parameters of other shapes and dtypes (packed ints, scales, zeros) with their own loaders.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.distributed import TensorParallel
from tokenmill.layers.parallel import CheckpointSlice, equal_slice, padded_slice

logger = logging.getLogger(__name__)
GEMV_PROBE_ROWS = (1, 4, 13)  # the GEMV's paths: one row, its most rows without tiles, tiles of 6 and a tail

ShardId = str | int | None
WeightLoader = Callable[[nn.Parameter, torch.Tensor, ShardId], None]


class LinearMethod(Protocol):
    def create_weights(self, layer: LinearBase, dtype: torch.dtype) -> None:
        """Register the layer's parameters (with their weight loaders) for its shape."""

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        """Turn the loaded parameters into the form `apply` reads (packing, repacking)."""

    def repacks(self, layer: LinearBase) -> bool:
        """Whether process_weights_after_loading replaces the layer's weight by a new tensor made from it and keeps
        nothing of the loaded one (a model loader may then assemble the weight in a reused buffer, or hand it
        the checkpoint's own pages, and process the layer as soon as it is loaded)."""

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        """x [..., input_size] -> [..., output_size]."""


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
    """Copy a checkpoint tensor of exactly the parameter's shape into it (casting its dtype)."""
    if shard_id is not None:
        raise ValueError(f"a parameter of shape {list(param.shape)} has no shard {shard_id!r}")
    if tuple(loaded.shape) != tuple(param.shape):
        raise ValueError(f"tensor shape {list(loaded.shape)} does not match the model's {list(param.shape)}")
    param.data.copy_(loaded)


def set_weight_loader(param: nn.Parameter, loader: WeightLoader) -> None:
    param.weight_loader = loader  # type: ignore[attr-defined]


def weight_loader_of(param: nn.Parameter) -> WeightLoader:
    loader: WeightLoader = getattr(param, "weight_loader", default_weight_loader)
    return loader


class WeightStaging:
    """Buffers that repacking layers' weights are loaded into: one is taken when a layer's first shard arrives and
    given back once the layer is repacked, so that loading a model faults in no memory for its unpacked weights
    beyond a buffer per shape that is loading at once, reused layer after layer."""

    def __init__(self) -> None:
        self._free: dict[tuple[tuple[int, ...], torch.dtype, torch.device], list[torch.Tensor]] = {}

    def take(self, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        free = self._free.get((tuple(shape), dtype, device))
        return free.pop() if free else torch.empty(tuple(shape), dtype=dtype, device=device)

    def give(self, buffer: torch.Tensor) -> None:
        self._free.setdefault((tuple(buffer.shape), buffer.dtype, buffer.device), []).append(buffer)


class LinearBase(nn.Module):
    """y = x W^T + b with W of [sum(output_sizes), input_size]. `output_sizes` lists the shards of a
    fused projection (q/k/v, or gate/up) in order; `shard_ids` names them for the loader."""

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool, dtype: torch.dtype,
                 method: LinearMethod, shard_ids: Sequence[ShardId] = (None,),
                 slices: Sequence[CheckpointSlice] = (), tp_reduce: TensorParallel | None = None) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_sizes = list(output_sizes)
        self.output_size = sum(output_sizes)
        self.has_bias = bias
        self.shard_ids = list(shard_ids)
        # tensor parallelism: each shard's part of its checkpoint tensor that this rank holds (none: all of
        # it), and for a row-parallel layer the group its partial products are summed over
        self.slices: dict[ShardId, CheckpointSlice] = dict(zip(self.shard_ids, slices, strict=True)) if slices else {}
        self.tp_reduce = tp_reduce if tp_reduce is not None and tp_reduce.size > 1 else None
        self.checkpoint_sizes = list(output_sizes)  # each shard's rows in the checkpoint (all ranks')
        if self.tp_reduce is not None and bias:
            raise ValueError("a row-parallel linear layer with a bias is not supported")
        self._loaded: set[tuple[str, ShardId]] = set()  # (parameter name, shard) the checkpoint filled
        # while a model loader drives the loading (tokenmill.models.loader): the buffers a repacking method's weight
        # is assembled in; `processed` once the method has processed the loaded layer
        self.staging: WeightStaging | None = None
        self._staged: torch.Tensor | None = None  # the staging buffer the weight is being loaded into
        self.processed = False
        self.method = method
        self.weight: nn.Parameter
        self.bias: nn.Parameter | None = None
        # the unquantized method's fast paths: whether `weight` is oneDNN-packed; the decode GEMV's ops (the C++
        # one over a packed weight, or on a GPU the Triton one over the plain weight) and the most rows it takes
        self.packed = False
        # the memory a packed weight reads where WeightPacker's packer wrote it: the oneDNN tensor does not own it
        self.packed_storage: torch.Tensor | None = None
        self.gemv_ops: Any = None
        self.gemv_max_rows = 0
        self.gemv_gated: Any = None  # gemv_ops.gated_gemv where it has one (resolved once: not per step)
        # a tied lm_head's embedding (Embedding.take_panels), handed the weight when the method stores it in
        # bf16_panels' layout, so that the one tensor serves both
        self.tied_embedding: Callable[[nn.Parameter], None] | None = None
        method.create_weights(self, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.method.apply(self, x)
        return y if self.tp_reduce is None else self.tp_reduce.all_reduce(y)

    def gated_forward(self, gate_up: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up times this layer's weight, gate and up the halves of `gate_up` [T, 2 * input_size],
        in one kernel: the decode GEMV's gated form where it takes these rows (`gemv_ops.gated_gemv`), else
        None (the caller runs the activation and then the layer)."""
        if self.gemv_gated is None or gate_up.dim() != 2 or gate_up.shape[0] > self.gemv_max_rows:
            return None
        y: torch.Tensor = self.gemv_gated(gate_up.contiguous(), self.weight, self.bias)
        return y if self.tp_reduce is None else self.tp_reduce.all_reduce(y)

    def shard_range(self, shard_id: ShardId, dim_size: int | None = None) -> tuple[int, int]:
        """Rows [start, end) of shard `shard_id` in a dimension of `output_size` (or `dim_size`, for
        quantized tensors whose rows are scaled, e.g. packed int4: dim_size = output_size // 8)."""
        if shard_id not in self.shard_ids:
            raise ValueError(f"no shard {shard_id!r} (shards: {self.shard_ids})")
        scale = (dim_size or self.output_size) / self.output_size
        start = sum(self.output_sizes[:self.shard_ids.index(shard_id)])
        size = self.output_sizes[self.shard_ids.index(shard_id)]
        return int(start * scale), int((start + size) * scale)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        """Copy a checkpoint tensor into its rows of a parameter whose first dimension is the output
        dimension (weight, bias, per-channel scales); a one-shard layer takes the whole tensor. Under
        tensor parallelism the tensor is first narrowed to this rank's slice. With `staging` set and a method that
        repacks, the weight is the tensor itself (a whole weight, the layer's last tensor) or a staging buffer, and
        the layer is processed once its last tensor is in (mark_loaded)."""
        if (cut := self.slices.get(shard_id)) is not None:
            loaded = cut.take(loaded)
        if self.staging is not None and self.method.repacks(self) and param is self.weight:
            if self._takes_as_is(loaded, shard_id):
                param.data = loaded  # the checkpoint's pages, repacked by mark_loaded before the next tensor
                self.mark_loaded("weight")
                return
            if self._staged is None:
                self._staged = param.data = self.staging.take(param.shape, param.dtype, param.device)
        if len(self.shard_ids) == 1 and shard_id is None:
            default_weight_loader(param, loaded)
        else:
            start, end = self.shard_range(shard_id, param.shape[0])
            dest = param.data[start:end]
            if tuple(loaded.shape) != tuple(dest.shape):
                raise ValueError(f"tensor shape {list(loaded.shape)} does not match the model's "
                                 f"{list(dest.shape)} (shard {shard_id!r})")
            dest.copy_(loaded)
        name = next(n for n, p in self.named_parameters(recurse=False) if p is param)
        self.mark_loaded(name, shard_id)

    def mark_loaded(self, param_name: str, shard_id: ShardId = None) -> None:
        self._loaded.add((param_name, shard_id))
        if self.staging is not None and not self.processed and self.method.repacks(self) and not self.missing_weights():
            self.process()

    def process(self) -> None:
        """Have the method process the loaded layer (once). A staging buffer the weight was assembled in goes back:
        a method that repacks keeps nothing of it."""
        if self.processed:
            return
        self.method.process_weights_after_loading(self)
        self.processed = True
        if self._staged is not None and self.staging is not None:
            self.staging.give(self._staged)
        self._staged = None

    def _takes_as_is(self, loaded: torch.Tensor, shard_id: ShardId) -> bool:
        """Whether the weight may be the checkpoint's tensor itself until it is repacked: the whole weight, in its
        dtype and layout, and nothing else of the layer left to load (so that it is repacked at once)."""
        return (len(self.shard_ids) == 1 and shard_id is None and loaded.dtype == self.weight.dtype
                and tuple(loaded.shape) == tuple(self.weight.shape) and loaded.is_contiguous()
                and loaded.device == self.weight.device and self.missing_weights() == ["weight"])

    def missing_weights(self) -> list[str]:
        """This layer's parameters (and shards of them) that nothing loaded (none once processed: its method may
        have replaced them by others)."""
        if self.processed:
            return []
        return [n if s is None else f"{n}[{s}]" for n, _ in self.named_parameters(recurse=False)
                for s in self.shard_ids if (n, s) not in self._loaded]

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_sizes}, bias={self.has_bias}"


class Linear(LinearBase):
    """One projection, loaded whole."""

    def __init__(self, input_size: int, output_size: int, bias: bool, dtype: torch.dtype,
                 method: LinearMethod) -> None:
        super().__init__(input_size, [output_size], bias, dtype, method)


class QKVLinear(LinearBase):
    """q, k and v projections fused into one matmul; the checkpoint's q_proj/k_proj/v_proj load into
    shards "q", "k", "v". Under tensor parallelism (column-parallel) it holds this rank's query heads
    and its KV heads (`TensorParallel.kv_heads`: a share, or one replicated head)."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 dtype: torch.dtype, method: LinearMethod, tp: TensorParallel | None = None) -> None:
        tp = tp or TensorParallel()
        heads = tp.split(num_heads, "num_attention_heads")
        kv_first, kv_heads = tp.kv_heads(num_kv_heads)
        sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
        slices: tuple[CheckpointSlice, ...] = ()
        if tp.size > 1:
            kv = CheckpointSlice(0, kv_first * head_dim, kv_heads * head_dim)
            slices = (CheckpointSlice(0, tp.rank * sizes[0], sizes[0]), kv, kv)
        super().__init__(hidden, sizes, bias, dtype, method, shard_ids=("q", "k", "v"), slices=slices)
        self.checkpoint_sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]


class MergedLinear(LinearBase):
    """Several projections of one input fused into one matmul (gate and up: shards 0 and 1); under
    tensor parallelism (column-parallel) each holds this rank's share of its rows."""

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool, dtype: torch.dtype,
                 method: LinearMethod, tp: TensorParallel | None = None) -> None:
        tp = tp or TensorParallel()
        slices = [equal_slice(n, tp) for n in output_sizes] if tp.size > 1 else []
        super().__init__(input_size, [tp.split(n) for n in output_sizes], bias, dtype, method,
                         shard_ids=tuple(range(len(output_sizes))), slices=slices)
        self.checkpoint_sizes = list(output_sizes)


class ColumnParallelLinear(LinearBase):
    """One projection whose output rows are split over the ranks (each computes its rows of y); with
    `padded`, the rows are padded up to a multiple of the ranks (the lm_head over the vocabulary)."""

    def __init__(self, input_size: int, output_size: int, bias: bool, dtype: torch.dtype, method: LinearMethod,
                 tp: TensorParallel, padded: bool = False) -> None:
        cut = padded_slice(output_size, tp) if padded else equal_slice(output_size, tp)
        super().__init__(input_size, [cut.size], bias, dtype, method, slices=[cut] if tp.size > 1 else [])
        self.checkpoint_sizes = [output_size]


class RowParallelLinear(LinearBase):
    """One projection whose input columns are split over the ranks: each multiplies its share of x
    (the column-parallel layer before gave it) and the partial products are summed over the ranks."""

    def __init__(self, input_size: int, output_size: int, bias: bool, dtype: torch.dtype, method: LinearMethod,
                 tp: TensorParallel) -> None:
        cut = equal_slice(input_size, tp, dim=1)
        super().__init__(cut.size, [output_size], bias, dtype, method, slices=[cut] if tp.size > 1 else [],
                         tp_reduce=tp)


class Embedding(nn.Embedding):
    """nn.Embedding without random initialisation: every weight comes from the checkpoint. `dtype`: the table's,
    where it is not the model's (`out_dtype`, which the rows are widened to: bf16 weights under a float32
    model, UnquantizedLinearMethod.weight_dtype). A tied lm_head stored in bf16_panels' layout hands its weight
    over (take_panels), and the rows are read from the panels then (embedding_rows)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype | None = None,
                 out_dtype: torch.dtype | None = None) -> None:
        super().__init__(num_embeddings, embedding_dim, dtype=dtype)
        self.out_dtype = out_dtype

    def reset_parameters(self) -> None:
        return None

    def take_panels(self, weight: nn.Parameter) -> None:
        """Read the rows from the tied lm_head's weight, which its method laid out in bf16_panels' layout."""
        if weight.shape[0] * PANEL != self.num_embeddings or weight.shape[1] != self.embedding_dim:
            raise ValueError(f"panels of shape {tuple(weight.shape)} do not hold a {self.num_embeddings} x "
                             f"{self.embedding_dim} table")
        self.weight = weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = embedding_rows(self.weight, input_ids)
        return rows if self.out_dtype is None else rows.to(self.out_dtype)


def embedding_for(vocab_size: int, hidden_size: int, dtype: torch.dtype, method: LinearMethod) -> Embedding:
    """The model's embedding table, in the linear layers' storage dtype where their method keeps one apart from
    the model's (so that a tied lm_head is that dtype too)."""
    stored = getattr(method, "weight_dtype", None)
    return Embedding(vocab_size, hidden_size) if stored is None else Embedding(vocab_size, hidden_size, stored, dtype)


# ---- the unquantized method ----------------------------------------------------------------------

def packing_available() -> bool:
    """Whether oneDNN packs bf16 weights here: its bf16 path needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT, and
    on a CPU without them (an AVX2-only one) packing raises."""
    return _packs(torch.bfloat16)


def float32_packing_available() -> bool:
    """Whether oneDNN packs float32 weights here."""
    return _packs(torch.float32)


@functools.cache
def _packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN's reorder takes a weight of this dtype, tried once on a small one."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.ones(64, 64, dtype=dtype), 1)
    except RuntimeError:
        return False
    return True


def onednn_rows(m: int) -> int:
    """The row count a oneDNN product of m rows runs with: m up to 16, else m rounded up to a multiple of an
    eighth of the largest power of two below m (at most 1/8 more rows). oneDNN builds a kernel for each row
    count it meets and caches it with a scratchpad of rows x K, so the exact counts of a server's varied steps
    would each cost a build and grow the process without a useful bound; rounded, a weight shape meets at most
    8 counts per power of two. kernels/cpu/linear/gemv.cpp's `onednn_rows` is the same function."""
    if m <= 16:
        return m
    step = 1 << ((m - 1).bit_length() - 4)
    return -(-m // step) * step


def in_onednn_rows(product: Callable[[torch.Tensor], torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
    """product(rows) for rows [m, K] -> [m, N], run on rows padded with zero rows to onednn_rows(m)."""
    m = rows.shape[0]
    padded = onednn_rows(m)
    if padded == m:
        return product(rows)
    return product(F.pad(rows, (0, 0, 0, padded - m)))[:m]


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, post_op: str = "none",
                  algorithm: str = "") -> torch.Tensor:
    """x [..., K] times a packed weight by oneDNN, in onednn_rows row counts; `post_op` (with its `algorithm`,
    e.g. "gelu" with "none" or "tanh") is applied to the float32 accumulator before the result's rounding."""
    rows = x.reshape(-1, x.shape[-1])
    out = in_onednn_rows(lambda r: torch.ops.mkldnn._linear_pointwise(r, weight, bias, post_op, [], algorithm), rows)
    return out.view(*x.shape[:-1], out.shape[-1])


def linear_gelu(layer: LinearBase, x: torch.Tensor, approximate: str) -> torch.Tensor:
    """F.gelu(layer(x), approximate=approximate), the GELU fused into oneDNN's product where the layer's weight
    is oneDNN-packed, x is in its dtype and the decode GEMV does not take these rows."""
    rows = x.numel() // layer.input_size
    if (layer.packed and layer.tp_reduce is None and x.dtype == layer.weight.dtype
            and (layer.gemv_ops is None or rows > layer.gemv_max_rows)):
        return onednn_linear(x, layer.weight, layer.bias, "gelu", approximate)
    return F.gelu(layer(x), approximate=approximate)


WIDEN_TILE_BYTES = 2 << 20  # widened_linear's float32 weight tile


def widened_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear of x (float32) and a bf16 weight widened to x's dtype a tile of output features at a time, so
    that no float32 copy of the whole weight is made."""
    n, k = weight.shape
    tile = max(16, WIDEN_TILE_BYTES // (4 * k))
    y = torch.empty(x.shape[0], n, dtype=x.dtype)
    for n0 in range(0, n, tile):
        n1 = min(n, n0 + tile)
        y[:, n0:n1] = F.linear(x, weight[n0:n1].to(x.dtype), None if bias is None else bias[n0:n1].to(x.dtype))
    return y


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """The weight reordered once into oneDNN's packed layout (the one chosen for batch 1 runs large
    batches at full speed too)."""
    packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)
    return packed


class WeightPacker:
    """Writes bf16 weights in oneDNN's packed layout. oneDNN's reorder (pack_weight) packs the first weight of each
    shape; where tokenmill's packer (ops.pack_ab16b64a2b, threads writing whole output blocks) writes the same bytes
    for it, that packer packs the rest of the shape's weights, wrapped as oneDNN tensors of the first one's memory
    descriptor. It reads and writes each weight once, as a copy does (bench/README.md, the forty-fourth session,
    times it against oneDNN's reorder). Elsewhere, and for other dtypes, oneDNN's reorder packs every weight."""

    def __init__(self, ops: Any) -> None:
        usable = ops is not None and hasattr(ops, "pack_ab16b64a2b") and bool(ops.has_onednn_over())
        self.ops = ops if usable else None
        self._descriptors: dict[tuple[int, int], torch.Tensor | None] = {}  # per (N, K); None: oneDNN's bytes differ

    def pack(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the packed weight, the tensor owning its bytes where that is not the packed weight itself: to be kept
        alive as long as the packed weight is used)."""
        weight = weight.detach()
        if self.ops is None or weight.dtype != torch.bfloat16 or weight.dim() != 2 or not weight.is_contiguous():
            return pack_weight(weight), None
        shape = (int(weight.shape[0]), int(weight.shape[1]))
        if shape not in self._descriptors:
            packed = pack_weight(weight)
            same = bool(self.ops.onednn_bytes_equal(packed, self.ops.pack_ab16b64a2b(weight)))
            self._descriptors[shape] = torch.ops.mkldnn._get_mkldnn_serialized_md(packed) if same else None
            if not same:
                logger.info("oneDNN packs a %d x %d weight in another layout than tokenmill's packer; oneDNN packs it",
                            *shape)
            return packed, None
        descriptor = self._descriptors[shape]
        if descriptor is None:
            return pack_weight(weight), None
        storage = self.ops.pack_ab16b64a2b(weight)
        return self.ops.onednn_over(storage, list(shape), descriptor), storage


class UnquantizedLinearMethod:
    """Float weights. `pack`: reorder bf16 CPU weights for oneDNN after loading (float32 ones where oneDNN has no
    bf16 path); weights stored in another dtype than the model's (`weight_dtype`) are packed only for
    `bf16_products`. `ops`:
    tokenmill's C++ CPU kernels, whose GEMV then takes as many rows as it is the faster kernel for, once a probe
    has checked that it reads this oneDNN's packed layout."""

    def __init__(self, ops: Any = None, pack: bool = True, weight_dtype: torch.dtype | None = None,
                 widen_ops: Any = None, bf16_products: bool = False) -> None:
        # weight_dtype bfloat16 under a float32 model (config.ModelConfig.linear_weight_dtype): the weights stay
        # bf16 and widen to float32 in the product. With widen_ops (C++, AVX2): stored in bf16_panels' layout and
        # multiplied by widen_ops.bf16p_gemm for every row count where the layer allows (panels_take); else as
        # loaded, by widen_ops.bf16w_gemv in the layers' GEMV slot up to its rows and widen_ops.bf16w_gemm beyond.
        # Without widen_ops: widened_linear, a tile at a time.
        # bf16_products (with weight_dtype bfloat16, under float32 layers): where oneDNN packs bf16 weights, they are
        # packed and multiplied in bf16 (AMX where there is one): each row rounded to bf16 on the way in, the product
        # widened to float32 as the bias is added. Elsewhere (a GPU, an AVX2-only CPU) the widening path above.
        self.weight_dtype = weight_dtype
        self.bf16_products = bf16_products and weight_dtype == torch.bfloat16
        self.widen_gemv = WidenedGemv(widen_ops) if widen_ops is not None else None
        self.panel_gemm = PanelGemm(widen_ops) if widen_ops is not None else None
        self.pack = pack and packing_available()
        # where oneDNN has no bf16 path (an AVX2-only CPU, where dtype auto is float32), float32 weights are packed
        # too: oneDNN's packed float32 product runs there where torch's F.linear takes MKL's
        self.pack_float32 = pack and not self.pack and float32_packing_available()
        self.gemv_ops = ops if ops is not None and self.pack and _gemv_usable(ops) else None
        # oneDNN chooses the packed layout per shape (on an AMX Xeon, N = 64 gets one of the same size that
        # the GEMV does not read), so each (N, K) is checked once against oneDNN's own product
        self._gemv_reads: dict[tuple[int, int], bool] = {}
        self.packer = WeightPacker(ops)

    def create_weights(self, layer: LinearBase, dtype: torch.dtype) -> None:
        if self.bf16_products and dtype != torch.float32:
            raise ValueError(f"bf16_products serves layers of one dtype, float32, not {dtype}")
        layer.weight = nn.Parameter(torch.empty(layer.output_size, layer.input_size, dtype=self.weight_dtype or dtype),
                                    requires_grad=False)
        set_weight_loader(layer.weight, layer.weight_loader)
        if layer.has_bias:
            layer.bias = nn.Parameter(torch.empty(layer.output_size, dtype=dtype), requires_grad=False)
            set_weight_loader(layer.bias, layer.weight_loader)

    def repacks(self, layer: LinearBase) -> bool:
        """oneDNN packs the weight: bf16 ones where oneDNN multiplies bf16, float32 ones where it has no bf16 path,
        and bf16-stored ones under a float32 model for bf16_products; on the CPU only."""
        weight = layer.weight
        if weight.device.type != "cpu":
            return False
        if self.weight_dtype is not None:
            return self.bf16_products and self.pack
        return (self.pack and weight.dtype == torch.bfloat16) or (self.pack_float32 and weight.dtype == torch.float32)

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        weight = layer.weight
        if self.repacks(layer):
            packed, layer.packed_storage = self.packer.pack(weight)
            layer.weight = nn.Parameter(packed, requires_grad=False)
            layer.packed = True
            if self.weight_dtype is None and self.gemv_ops is not None and self._gemv_reads_shape(layer):
                self.enable_gemv(layer, self.gemv_ops)
            return
        if self.weight_dtype is not None:  # widened in the product
            if self.panel_gemm is not None and weight.device.type == "cpu" and panels_take(layer):
                layer.weight = nn.Parameter(self.panel_gemm.panels(weight.detach()), requires_grad=False)
                self.enable_gemv(layer, self.panel_gemm)
                if layer.tied_embedding is not None:
                    layer.tied_embedding(layer.weight)
            elif self.widen_gemv is not None:
                self.enable_gemv(layer, self.widen_gemv)

    def _gemv_reads_shape(self, layer: LinearBase) -> bool:
        key = (layer.output_size, layer.input_size)
        if key not in self._gemv_reads:
            self._gemv_reads[key] = gemv_matches_onednn(self.gemv_ops, layer.weight, layer.input_size)
            if not self._gemv_reads[key]:
                logger.info("oneDNN packs a %d x %d weight in a layout the GEMV does not read; oneDNN runs it",
                            *key)
        return self._gemv_reads[key]

    @staticmethod
    def enable_gemv(layer: LinearBase, ops: Any) -> None:
        """Take ops.packed_gemv for as many rows as it is the faster kernel for (up to
        ops.packed_gemv_max_rows(input_size)); oneDNN (packed) or F.linear beyond."""
        layer.gemv_ops = ops
        layer.gemv_max_rows = int(ops.packed_gemv_max_rows(layer.input_size))
        layer.gemv_gated = getattr(ops, "gated_gemv", None)

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        if layer.gemv_ops is not None and x.numel() <= layer.gemv_max_rows * layer.input_size:
            rows = x.reshape(-1, layer.input_size).contiguous()
            y: torch.Tensor = layer.gemv_ops.packed_gemv(rows, layer.weight, layer.bias)
            return y.view(*x.shape[:-1], layer.output_size)
        if not layer.packed:
            if self.bf16_products:  # unpacked (no oneDNN bf16 here): float32 rows, widened weights
                x = x.float()
            if layer.weight.dtype != x.dtype:  # bf16-stored weights under a float32 model, past the GEMV's rows
                rows = x.reshape(-1, layer.input_size)
                if isinstance(layer.gemv_ops, WidenedGemv):  # the C++ product that widens as it packs
                    y = layer.gemv_ops.gemm(rows if rows.stride(-1) == 1 else rows.contiguous(), layer.weight,
                                            layer.bias)
                else:
                    y = widened_linear(rows, layer.weight, layer.bias)
                return y.view(*x.shape[:-1], layer.output_size)
            return F.linear(x, layer.weight, layer.bias)
        if self.bf16_products:  # the bf16 product widens exactly as it meets the float32 bias, in one pass
            y = onednn_linear(x.to(layer.weight.dtype), layer.weight, None)
            return y.float() if layer.bias is None else torch.add(y, layer.bias)
        return onednn_linear(x, layer.weight, layer.bias)

    @staticmethod
    def gemv_data_ptr(layer: LinearBase) -> int:
        """The packed weight's address, for C++ callers of the GEMV that skip the op's per-call lookup
        (valid while the layer lives), or 0 where the GEMV does not take this weight."""
        if layer.gemv_ops is None or not _is_ab16b64a2b(layer.weight, layer.output_size, layer.input_size):
            return 0
        return int(torch.ops.mkldnn.data_ptr(layer.weight))


class WidenedGemv:
    """The C++ GEMV over bf16-stored weights (kernels/cpu/linear/bf16w_gemv.cpp) in the form the layers' GEMV
    slot takes (`LinearBase.gemv_ops`, as the packed GEMV and the Triton one), and the C++ product for more rows
    (bf16w_gemm.cpp: the weight widened as it is packed, a panel at a time)."""

    def __init__(self, ops: Any) -> None:
        self.packed_gemv = ops.bf16w_gemv
        self.gemm = ops.bf16w_gemm
        self.max_rows = int(ops.bf16w_gemv_max_rows())

    def packed_gemv_max_rows(self, input_size: int) -> int:
        return self.max_rows


class PanelGemm:
    """The C++ product over bf16 weights stored in bf16_panels' layout (kernels/cpu/linear/bf16w_gemm.cpp's
    bf16p_gemm) in the layers' GEMV slot, for every row count: at one row it reads the weights at the widening
    GEMV's rate, past a few it runs faster than that GEMV and than bf16w_gemm (bench/README.md)."""

    def __init__(self, ops: Any) -> None:
        self.packed_gemv = ops.bf16p_gemm
        self._to_panels = ops.bf16_panels_

    def panels(self, weight: torch.Tensor) -> torch.Tensor:
        """A layer's loaded weight in bf16_panels' layout: rearranged in place by the C++ op where the weight is a
        contiguous tensor of its own (no second copy of it is ever held), else copied by bf16_panels."""
        if weight.is_contiguous() and weight._base is None and weight.storage_offset() == 0:
            panels: torch.Tensor = self._to_panels(weight)
            return panels
        return bf16_panels(weight)

    @staticmethod
    def packed_gemv_max_rows(input_size: int) -> int:
        return sys.maxsize // max(1, input_size)  # any


PANEL = 16  # output columns a panel of bf16_panels holds


def panels_take(layer: LinearBase) -> bool:
    """Whether a bf16-stored layer's weight may be kept in bf16_panels' layout: bf16, in whole panels."""
    return layer.output_size % PANEL == 0 and layer.weight.dtype == torch.bfloat16


def bf16_panels(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 [N, K] weight (N a multiple of 16) in bf16p_gemm's layout: [N / 16, K, 16], panel p holding output
    columns 16p .. 16p + 15, and at each k the 32-bit word i holding column i in its low half and column 8 + i in
    its high half (so that a shift and a mask widen a k's 16 weights to columns 0..7 and 8..15)."""
    n, k = weight.shape
    if n % PANEL:
        raise ValueError(f"bf16_panels: {n} output features is not a multiple of {PANEL}")
    return weight.reshape(n // PANEL, 2, PANEL // 2, k).permute(0, 3, 2, 1).contiguous().view(n // PANEL, k, PANEL)


def embedding_rows(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of an embedding table ([*ids.shape, K]): a [N, K] one as F.embedding reads it, or a tied lm_head's
    weight in bf16_panels' layout ([N / 16, K, 16]), read with the same range check."""
    if table.dim() == 2:
        return F.embedding(ids, table)
    flat = ids.reshape(-1)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= table.shape[0] * PANEL):
        raise IndexError("index out of range in self")  # (as F.embedding says it)
    slot = (flat % (PANEL // 2)) * 2 + (flat % PANEL) // (PANEL // 2)
    return table[flat // PANEL, :, slot].view(*ids.shape, table.shape[1])


def use_triton_gemv(model: nn.Module, ops: Any) -> int:
    """Give every unquantized linear layer whose weight is a plain row-major matrix (not oneDNN-packed: on a
    GPU, every one) the decode GEMV of `ops` (kernels/triton/gemv.py's TritonGemv) for batches up to its row
    limit. Returns how many layers took it."""
    layers = [m for m in model.modules() if isinstance(m, LinearBase) and isinstance(m.method, UnquantizedLinearMethod)
              and not m.packed and m.weight.dim() == 2 and m.weight.is_contiguous()]
    for m in layers:
        UnquantizedLinearMethod.enable_gemv(m, ops)
    return len(layers)


def packed_linear(weight: torch.Tensor, bias: torch.Tensor | None, ops: Any = None,
                  method: UnquantizedLinearMethod | None = None) -> Linear:
    """A packed bf16 layer holding a copy of these weights: with `method`, packed and given the GEMV as
    that method decides (after its probe); else GEMV from `ops` without the probe, for tests and tools
    that compare the packed paths with F.linear."""
    use = method if method is not None else UnquantizedLinearMethod()
    layer = Linear(weight.shape[1], weight.shape[0], bias is not None, weight.dtype, use)
    layer.weight.data.copy_(weight)
    if bias is not None and layer.bias is not None:
        layer.bias.data.copy_(bias)
    use.process_weights_after_loading(layer)
    if method is None and ops is not None and layer.packed:  # (the C++ GEMV reads packed weights only)
        use.enable_gemv(layer, ops)
    return layer


@torch.no_grad()
def gemv_layout_ok(ops: Any) -> bool:
    """Whether ops.packed_gemv, which decodes oneDNN's packed layout itself, matches F.linear on
    this machine's oneDNN: awkward shapes (padding in N and K) and aligned ones, at GEMV_PROBE_ROWS."""
    gen = torch.Generator().manual_seed(0)
    for out_features, in_features in ((70, 33), (128, 64), (200, 96)):
        weight = torch.randn(out_features, in_features, generator=gen).to(torch.bfloat16)
        bias = torch.randn(out_features, generator=gen).to(torch.bfloat16)
        layer = packed_linear(weight, bias)
        if not _is_ab16b64a2b(layer.weight, out_features, in_features):
            return False
        for rows in GEMV_PROBE_ROWS:
            x = torch.randn(rows, in_features, generator=gen).to(torch.bfloat16)
            expected = F.linear(x.float(), weight.float(), bias.float())
            got = ops.packed_gemv(x, layer.weight, layer.bias).float()
            # bf16 output rounding is 2^-8 relative; a layout error is off by the outputs' own size
            if not torch.allclose(got, expected, rtol=2**-7, atol=1e-2 * float(expected.abs().max())):
                return False
    return True


@torch.no_grad()
def gemv_matches_onednn(ops: Any, packed: torch.Tensor, in_features: int) -> bool:
    """Whether ops.packed_gemv over this packed weight gives oneDNN's product (a layout check: the same
    bytes read in another order are off by the outputs' own size, not by rounding)."""
    out_features = int(packed.size(0))
    if not _is_ab16b64a2b(packed, out_features, in_features):
        return False
    gen = torch.Generator().manual_seed(0)
    for rows in GEMV_PROBE_ROWS:
        x = torch.randn(rows, in_features, generator=gen).to(torch.bfloat16)
        expected = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "").float()
        got = ops.packed_gemv(x, packed, None).float()
        if not torch.allclose(got, expected, rtol=2**-6, atol=1e-2 * float(expected.abs().max())):
            return False
    return True


def _is_ab16b64a2b(weight: torch.Tensor, out_features: int, in_features: int) -> bool:
    """Whether the packed buffer has the size of that layout (N padded to 64, K to 32). oneDNN picks
    other layouts elsewhere (an AMX Xeon pads N to 32), and the GEMV must not even be called then."""
    if not weight.is_mkldnn:
        return False
    padded = -(-out_features // 64) * 64 * -(-in_features // 32) * 32
    return int(torch.ops.mkldnn._nbytes(weight)) == padded * 2


def _gemv_usable(ops: Any) -> bool:
    if not ops.has_packed_gemv():
        logger.info("packed GEMV not built (no AVX512-BF16); using oneDNN")
        return False
    try:
        ok = gemv_layout_ok(ops)
    except RuntimeError as e:  # e.g. the packed buffer is not the size the layout implies
        logger.info("packed GEMV check failed (%s); using oneDNN", e)
        return False
    if not ok:
        logger.info("oneDNN's packed weight layout is not the one the GEMV reads; using oneDNN")
    return ok
