"""What each attention layer keeps in the KV cache, described without torch, and the plan that sizes
the pool from it.

Every attention layer declares a `KVCacheSpec` (layers/attention.py). Layers with equal specs form a
`KVCacheGroup`; all groups share one block table per request (a block id names the same slot range in
every layer's cache), so the pool's size is the budget divided by the bytes one block costs across all
layers. The engine core plans the pool from the workers' specs (`plan_kv_cache`), the workers allocate
each group's tensor from the resulting `KVCacheConfig`, and the scheduler's block pool gets its
`num_blocks`. Layers of different windows (Gemma's local and global layers) are groups of one plan: a
sliding layer keeps every block, as a full one does, and reads only its window. A second model (a
speculative-decoding draft) is planned and allocated the same way, with its own budget and its own config.
"""

from __future__ import annotations

from dataclasses import dataclass

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "int8": 1, "uint8": 1, "float8_e4m3fn": 1}
FLOAT_DTYPES = ("float32", "bfloat16", "float16")  # the dtypes weights and activations run in

# `--kv-cache-dtype` (vLLM's names) -> the cache's storage dtype; "auto" stores the model's dtype
KV_CACHE_DTYPE_CHOICES = ("auto", "int8", "fp8", "fp8_e4m3")
_KV_STORAGE = {"int8": "int8", "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn"}
# storage dtypes kept with one float32 scale per token and kv head (K and V each), beside the blocks
QUANTIZED_KV_DTYPES = ("int8", "float8_e4m3fn")
KV_SCALE_BYTES = 4


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: str) -> str:
    """The dtype the KV cache stores for a `--kv-cache-dtype` choice."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in _KV_STORAGE:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} unknown; choose from {', '.join(KV_CACHE_DTYPE_CHOICES)}")
    return _KV_STORAGE[kv_cache_dtype]


@dataclass(frozen=True)
class KVCacheSpec:
    """One layer's cache: `block_size` tokens per block, elements of `dtype` (a torch dtype's name)."""

    block_size: int
    dtype: str

    @property
    def bytes_per_token(self) -> int:
        raise NotImplementedError

    @property
    def quantized(self) -> bool:
        """Whether elements are stored quantized, with a scale per token and kv head (`scale_shape`)."""
        return self.dtype in QUANTIZED_KV_DTYPES

    @property
    def page_size_bytes(self) -> int:
        """Bytes one block of this layer holds."""
        return self.block_size * self.bytes_per_token

    def block_shape(self) -> tuple[int, ...]:
        """The shape of one block of this layer's cache tensor."""
        raise NotImplementedError


@dataclass(frozen=True)
class FullAttentionSpec(KVCacheSpec):
    """Keys and values of every position: a [2, blocks, block_size, num_kv_heads, head_size] tensor; a
    quantized one also keeps a [2, blocks, block_size, num_kv_heads] float32 tensor of scales (the value
    is element * scale)."""

    num_kv_heads: int
    head_size: int

    @property
    def bytes_per_token(self) -> int:
        scale = KV_SCALE_BYTES if self.quantized else 0
        return 2 * self.num_kv_heads * (self.head_size * DTYPE_BYTES[self.dtype] + scale)

    def block_shape(self) -> tuple[int, ...]:
        return (self.block_size, self.num_kv_heads, self.head_size)

    def scale_shape(self) -> tuple[int, ...]:
        """The shape of one block of this layer's scales (quantized dtypes only)."""
        return (self.block_size, self.num_kv_heads)


@dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    """Full-attention layout, read only over the last `sliding_window` positions."""

    sliding_window: int


@dataclass(frozen=True)
class MLAAttentionSpec(KVCacheSpec):
    """Multi-head latent attention: one compressed latent plus the decoupled rope key per position, a
    [blocks, block_size, kv_lora_rank + qk_rope_head_dim] tensor (no separate K and V)."""

    kv_lora_rank: int
    qk_rope_head_dim: int

    @property
    def bytes_per_token(self) -> int:
        return (self.kv_lora_rank + self.qk_rope_head_dim) * DTYPE_BYTES[self.dtype]

    def block_shape(self) -> tuple[int, ...]:
        return (self.block_size, self.kv_lora_rank + self.qk_rope_head_dim)


@dataclass(frozen=True)
class KVCacheGroup:
    spec: KVCacheSpec
    layer_names: tuple[str, ...]


@dataclass(frozen=True)
class KVCacheConfig:
    num_blocks: int
    block_size: int
    groups: tuple[KVCacheGroup, ...]

    @property
    def bytes_per_block(self) -> int:
        return sum(g.spec.page_size_bytes * len(g.layer_names) for g in self.groups)



def group_layers(specs: dict[str, KVCacheSpec]) -> tuple[KVCacheGroup, ...]:
    """Layers with equal specs, in the order their first layer appears."""
    groups: dict[KVCacheSpec, list[str]] = {}
    for name, spec in specs.items():
        groups.setdefault(spec, []).append(name)
    return tuple(KVCacheGroup(spec, tuple(names)) for spec, names in groups.items())


def plan_kv_cache(specs: dict[str, KVCacheSpec], budget_bytes: int, num_blocks: int | None = None) -> KVCacheConfig:
    """The pool for these layers: `num_blocks` where given, else as many blocks as fit in the budget."""
    if not specs:
        raise ValueError("the model declares no attention layer, so it has no KV cache to plan")
    block_sizes = {s.block_size for s in specs.values()}
    if len(block_sizes) != 1:
        raise ValueError(f"every layer's KV blocks must hold the same number of tokens, got {sorted(block_sizes)}")
    groups = group_layers(specs)
    per_block = sum(g.spec.page_size_bytes * len(g.layer_names) for g in groups)
    blocks = num_blocks if num_blocks is not None else max(1, budget_bytes // per_block)
    return KVCacheConfig(blocks, block_sizes.pop(), groups)
