"""Checkpoint formats of quantized weights: the parameters each one registers on a linear layer (named
as its checkpoints name the tensors, with loaders that place each fused shard), and how they become one
integer form the methods pack for the kernels:

- int8 / W8A8: `IntWeights(q int8 [N, K], scale fp32 [N])`;
- int4: `IntWeights(q uint8 [N, K] in 0..15, scale fp32 [N, G], zero fp32 [N, G], perm)`, w = (q - zero) *
  scale, the columns of x taken in `perm`'s order where GPTQ's act-order permuted the groups.

Layouts, from each format's own description:
- compressed-tensors int8 (`int-quantized`): `weight` int8 [N, K], `weight_scale` [N, 1].
- compressed-tensors `pack-quantized` int4: `weight_packed` int32 [N, ceil(K / 8)], value k in bits
  4 (k % 8) of word k // 8, stored as q + 8 (q signed); `weight_scale` [N, G]; with zero points
  `weight_zero_point` int32 [ceil(N / 8), G], packed the same way down the output dimension.
- GPTQ: `qweight` int32 [K / 8, N], k in bits 4 (k % 8) of row k // 8; `qzeros` int32 [G, N / 8], n in
  bits 4 (n % 8) of column n // 8, stored as zero - 1 in the original (v1) format; `scales` [G, N];
  `g_idx` int32 [K], the group of each input column (act-order).
- AWQ (GEMM): `qweight` int32 [K, N / 8] and `qzeros` int32 [G, N / 8], nibble i of column c holding
  output c * 8 + (0, 2, 4, 6, 1, 3, 5, 7)[i]; `scales` [G, N].
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tokenmill.layers.linear import LinearBase, ShardId, set_weight_loader
from tokenmill.layers.quantization import reference as ref
from tokenmill.quantization_config import INT4_K_ALIGN, QuantConfig

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
Loader = Callable[[nn.Parameter, torch.Tensor, ShardId], None]


@dataclass
class IntWeights:
    q: torch.Tensor  # int8 [N, K], or int4 values uint8 [N, K] (already in pack_int4's layout where `packed`)
    scale: torch.Tensor
    zero: torch.Tensor | None = None
    perm: torch.Tensor | None = None
    packed: bool = False
    wsum: torch.Tensor | None = None  # int8's row sums (reference.weight_sum), where made with q


def group_of(cfg: QuantConfig, in_features: int) -> int:
    return cfg.group_size if cfg.group_size is not None else in_features


# ---- parameters and their loaders ------------------------------------------------------------------------

def _describe(cfg: QuantConfig) -> str:
    group = f"group size {cfg.group_size}" if cfg.group_size else "one group per row"
    return f"{cfg.format} {cfg.scheme}, {group}"


def _along(layer: LinearBase, dim: int, cfg: QuantConfig, dtype: torch.dtype | None = None) -> Loader:
    """A loader placing each shard along `dim`, the tensor's output dimension (packed or not)."""
    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        if dtype is not None and loaded.dtype != dtype:
            raise ValueError(f"is {loaded.dtype}, the {cfg.format} format stores {dtype}")
        dest = param.data
        if not (len(layer.shard_ids) == 1 and shard_id is None):
            size = param.shape[dim]
            if any(s * size % layer.output_size for s in layer.output_sizes):
                raise ValueError(f"its packed output dimension does not split into the shards {layer.output_sizes}")
            start, end = layer.shard_range(shard_id, size)
            dest = dest.narrow(dim, start, end - start)
        if tuple(loaded.shape) != tuple(dest.shape):
            raise ValueError(f"tensor shape {list(loaded.shape)} does not match the model's {list(dest.shape)} "
                             f"({_describe(cfg)}{'' if shard_id is None else f'; shard {shard_id!r}'})")
        dest.copy_(loaded)
        name = next(n for n, p in layer.named_parameters(recurse=False) if p is param)
        layer.mark_loaded(name, shard_id)
    return load


def _per_shard(layer: LinearBase) -> Loader:
    """A loader for a tensor every shard carries whole (GPTQ's g_idx): one row per shard."""
    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        row = 0 if shard_id is None else layer.shard_ids.index(shard_id)
        if tuple(loaded.shape) != tuple(param.shape[1:]):
            raise ValueError(f"tensor shape {list(loaded.shape)} does not match the model's {list(param.shape[1:])}")
        param.data[row].copy_(loaded)
        name = next(n for n, p in layer.named_parameters(recurse=False) if p is param)
        layer.mark_loaded(name, shard_id)
    return load


def add_param(layer: LinearBase, name: str, shape: tuple[int, ...], dtype: torch.dtype, loader: Loader) -> None:
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    set_weight_loader(param, loader)
    setattr(layer, name, param)


def create_checkpoint_params(cfg: QuantConfig, layer: LinearBase, dtype: torch.dtype) -> None:
    """Register the format's parameters on `layer` (and a float bias where it has one)."""
    n, k = layer.output_size, layer.input_size
    g = ref.num_groups(k, group_of(cfg, k))
    if layer.has_bias:
        add_param(layer, "bias", (n,), dtype, layer.weight_loader)
    if cfg.format == "rtn":
        add_param(layer, "weight", (n, k), dtype, layer.weight_loader)
    elif cfg.format == "compressed-tensors" and cfg.scheme != "int4":
        add_param(layer, "weight", (n, k), torch.int8, _along(layer, 0, cfg, torch.int8))
        add_param(layer, "weight_scale", (n, 1), torch.float32, _along(layer, 0, cfg))
    elif cfg.format == "compressed-tensors":
        add_param(layer, "weight_packed", (n, -(-k // 8)), torch.int32, _along(layer, 0, cfg, torch.int32))
        add_param(layer, "weight_scale", (n, g), torch.float32, _along(layer, 0, cfg))
        if cfg.zero_point:
            add_param(layer, "weight_zero_point", (-(-n // 8), g), torch.int32, _along(layer, 0, cfg, torch.int32))
    else:
        if k % 8 or n % 8:
            raise ValueError(f"{cfg.format} packs 8 values per int32, so the layer's sizes [{n}, {k}] must be "
                             "multiples of 8")
        if cfg.format == "gptq":
            add_param(layer, "qweight", (k // 8, n), torch.int32, _along(layer, 1, cfg, torch.int32))
            if cfg.act_order:
                add_param(layer, "g_idx", (len(layer.shard_ids), k), torch.int32, _per_shard(layer))
        else:
            add_param(layer, "qweight", (k, n // 8), torch.int32, _along(layer, 1, cfg, torch.int32))
        add_param(layer, "qzeros", (g, n // 8), torch.int32, _along(layer, 1, cfg, torch.int32))
        add_param(layer, "scales", (g, n), torch.float32, _along(layer, 1, cfg))


# ---- to the integer form ----------------------------------------------------------------------------------

def _nibbles(packed: torch.Tensor, dim: int, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """int32 words holding 8 nibbles -> the nibbles (int32, 0..15) along `dim`, nibble i of word w at
    position w * 8 + order[i]."""
    shifts = torch.tensor([4 * order.index(j) for j in range(8)], dtype=torch.int32, device=packed.device)
    p = packed.movedim(dim, -1)
    out = (p[..., None] >> shifts) & 0xF
    return out.reshape(*p.shape[:-1], -1).movedim(-1, dim)


def _t(layer: LinearBase, name: str) -> torch.Tensor:
    t = getattr(layer, name)
    assert isinstance(t, torch.Tensor), name
    return t.data


def to_int_weights(cfg: QuantConfig, layer: LinearBase, ops: Any = None) -> IntWeights:
    """The layer's checkpoint parameters as IntWeights (the parameters are left in place). ops: tokenmill's C++
    CPU kernels, whose rtn_int8 / rtn_int4 round a CPU weight to the reference's integers in one pass."""
    n, k = layer.output_size, layer.input_size
    if cfg.format == "rtn":
        weight = _t(layer, "weight")
        in_op = ops is not None and weight.device.type == "cpu"
        if cfg.scheme == "int4":
            group = group_of(cfg, k)
            if in_op and (group % INT4_K_ALIGN == 0 or group >= k):
                packed, scale, zero = ops.rtn_int4(weight, group, cfg.zero_point)
                return IntWeights(packed, scale, zero, packed=True)
            return IntWeights(*ref.rtn_int4(weight, group, cfg.zero_point))
        if in_op:
            q, scale, wsum = ops.rtn_int8(weight)
            return IntWeights(q, scale, wsum=wsum)
        return IntWeights(*ref.rtn_int8(weight))
    if cfg.format == "compressed-tensors" and cfg.scheme != "int4":
        return IntWeights(_t(layer, "weight"), _t(layer, "weight_scale")[:, 0].contiguous())
    if cfg.format == "compressed-tensors":
        q = _nibbles(_t(layer, "weight_packed"), 1)[:, :k]
        zero = (_nibbles(_t(layer, "weight_zero_point"), 0)[:n].float() if cfg.zero_point
                else torch.full_like(_t(layer, "weight_scale"), 8.0))
        return IntWeights(q.to(torch.uint8), _t(layer, "weight_scale"), zero)
    if cfg.format == "gptq":
        q = _nibbles(_t(layer, "qweight"), 0).T
        zero = _nibbles(_t(layer, "qzeros"), 1).float() + cfg.gptq_zero_offset
    else:
        q = _nibbles(_t(layer, "qweight"), 1, AWQ_ORDER).T
        zero = _nibbles(_t(layer, "qzeros"), 1, AWQ_ORDER).float()
    perm = _act_order(cfg, layer) if cfg.act_order else None
    if perm is not None:
        q = q[:, perm]
    return IntWeights(q.to(torch.uint8).contiguous(), _t(layer, "scales").T.contiguous(), zero.T.contiguous(), perm)


def _act_order(cfg: QuantConfig, layer: LinearBase) -> torch.Tensor | None:
    """The column order that makes GPTQ's act-order groups contiguous (None: already in order)."""
    g_idx = _t(layer, "g_idx").long()
    if not bool((g_idx == g_idx[0]).all()):
        raise ValueError("g_idx differs between the fused shards (q/k/v or gate/up), which share one input")
    g_idx = g_idx[0]
    k = layer.input_size
    perm = torch.argsort(g_idx, stable=True)
    expected = torch.arange(k) // group_of(cfg, k)
    if not torch.equal(g_idx[perm], expected):
        raise ValueError(f"g_idx does not assign {group_of(cfg, k)} input columns to each group "
                         "(group size in quantization_config does not match the checkpoint)")
    return None if torch.equal(perm, torch.arange(k)) else perm


def checkpoint_param_names(layer: LinearBase) -> list[str]:
    return [name for name, _ in layer.named_parameters(recurse=False) if name != "bias"]
