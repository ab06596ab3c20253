"""Allocates the KV cache a `KVCacheConfig` describes and binds it to a model's attention layers.

Each group of layers with the same spec gets one tensor, [layers, 2, num_blocks, *block] for K/V
layouts and [layers, num_blocks, *block] for latent ones, lazily faulted on the CPU (worker/memory.py);
each layer is bound to its slice. A quantized group (int8 / fp8 KV) also gets its scales, one float32 per
token and kv head, [layers, 2, num_blocks, block_size, num_kv_heads], listed in `groups` beside the
elements (block index at dimension 2, as theirs). A draft model gets its own config and so its own tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from tokenmill.attention.backend import AttentionBackend
from tokenmill.kv_cache_spec import FullAttentionSpec, KVCacheConfig, KVCacheSpec
from tokenmill.layers.attention import attention_layers
from tokenmill.worker.memory import zeros_lazily


@dataclass
class KVCacheTensors:
    by_layer: dict[str, torch.Tensor]  # each layer's cache
    groups: list[tuple[torch.Tensor, int]]  # each group's whole tensor and the dimension of its block index
    scales_by_layer: dict[str, torch.Tensor] = field(default_factory=dict)  # a quantized layer's scales

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t, _ in self.groups)


def kv_cache_specs(model: nn.Module, block_size: int, dtype: str) -> dict[str, KVCacheSpec]:
    """Each attention layer's spec, by module name; `dtype` is the cache's storage dtype."""
    specs = {name: layer.kv_cache_spec(block_size, dtype) for name, layer in attention_layers(model).items()}
    for name, spec in specs.items():
        if spec.quantized and not isinstance(spec, FullAttentionSpec):
            raise ValueError(f"a {dtype} KV cache is not supported for layer {name} ({type(spec).__name__}); "
                             "use --kv-cache-dtype auto")
    return specs


def allocate_kv_caches(config: KVCacheConfig, device: torch.device) -> KVCacheTensors:
    by_layer: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    groups: list[tuple[torch.Tensor, int]] = []
    for group in config.groups:
        spec = group.spec
        dtype = getattr(torch, spec.dtype)
        pair = (2,) if isinstance(spec, FullAttentionSpec) else ()
        shape = (len(group.layer_names), *pair, config.num_blocks, *spec.block_shape())
        tensor = zeros_lazily(shape, dtype, device)
        groups.append((tensor, 1 + len(pair)))
        for i, name in enumerate(group.layer_names):
            by_layer[name] = tensor[i]
        if spec.quantized and isinstance(spec, FullAttentionSpec):
            shape = (len(group.layer_names), 2, config.num_blocks, *spec.scale_shape())
            scale_tensor = zeros_lazily(shape, torch.float32, device)
            groups.append((scale_tensor, 2))
            for i, name in enumerate(group.layer_names):
                scales[name] = scale_tensor[i]
    return KVCacheTensors(by_layer, groups, scales)


def copy_blocks(caches: KVCacheTensors, pairs: list[tuple[int, int]]) -> None:
    """Copy-on-write: each (source, destination) block's contents, in order, in every group's tensor
    (every layer's K and V or latents, and a quantized group's scales)."""
    for tensor, dim in caches.groups:
        for src, dst in pairs:
            tensor.select(dim, dst).copy_(tensor.select(dim, src))


def read_blocks(caches: KVCacheTensors, block_ids: list[int]) -> list[bytes]:
    """Each block's KV as bytes, for the second tier: every group's slice of it (every layer's K and V or
    latents, and a quantized group's scales) in the order of `groups`."""
    out = []
    for block_id in block_ids:
        parts = [tensor.select(dim, block_id).contiguous().view(torch.uint8).reshape(-1).cpu().numpy().tobytes()
                 for tensor, dim in caches.groups]
        out.append(b"".join(parts))
    return out


def write_blocks(caches: KVCacheTensors, loads: list[tuple[int, bytes]]) -> None:
    """Write bytes read_blocks made back into blocks (of the same layout): each (block id, bytes)."""
    for block_id, payload in loads:
        offset = 0
        for tensor, dim in caches.groups:
            dst = tensor.select(dim, block_id)
            nbytes = dst.numel() * dst.element_size()
            src = torch.frombuffer(bytearray(payload[offset:offset + nbytes]), dtype=torch.uint8)
            dst.copy_(src.view(dst.dtype).view(dst.shape))
            offset += nbytes
        if offset != len(payload):
            raise ValueError(f"a KV block of {len(payload)} bytes does not fit this cache's {offset}-byte blocks")


def bind_kv_caches(model: nn.Module, caches: KVCacheTensors, backend: AttentionBackend) -> None:
    layers = attention_layers(model)
    if set(layers) != set(caches.by_layer):
        raise ValueError("the KV cache config does not name this model's attention layers")
    for name, layer in layers.items():
        layer.bind(caches.by_layer[name], backend, caches.scales_by_layer.get(name))
