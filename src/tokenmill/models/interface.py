"""The interface every model implements, and the optional ones a runner's fast paths look for.

A model is built as `cls(arch, options)` under its device's context (parameters allocated, not
initialised), filled by `load_weights` from the checkpoint walk (models/loader.py), and run by the
runner over a flat batch: `forward(input_ids, positions, meta, rows)` then `compute_logits` on the
rows it samples. Its attention layers are `layers.attention.PagedAttention`s, which declare their KV
cache specs and to which the worker binds the cache and the backend.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from tokenmill.attention.backend import AttentionMetadata, KVScales, OutputRows
from tokenmill.distributed import PipelineParallel, TensorParallel
from tokenmill.layers.linear import LinearBase, LinearMethod, UnquantizedLinearMethod


@dataclass
class ModelOptions:
    """What a model is built with besides its architecture."""

    dtype: torch.dtype
    linear_method: LinearMethod = field(default_factory=UnquantizedLinearMethod)
    # the lm_head's, where it differs (quantized checkpoints keep a float lm_head); None: linear_method
    lm_head_method: LinearMethod | None = None
    # this rank's place in the tensor-parallel group (the Llama family shards its layers by it)
    tp: TensorParallel = field(default_factory=TensorParallel)
    # this rank's pipeline stage (the Llama family builds only the stage's layers)
    pp: PipelineParallel = field(default_factory=PipelineParallel)


@dataclass
class IntermediateTensors:
    """What a pipeline stage hands the next: the last layer's output, not yet added to the residual
    stream, and the residual stream ([T, hidden] each, every row of the flat batch)."""

    hidden: torch.Tensor
    residual: torch.Tensor


@runtime_checkable
class CausalLM(Protocol):
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                rows: OutputRows | None = None) -> torch.Tensor:
        """The final hidden states [T, hidden] of every row of the flat batch, or with `rows` of those
        rows only, in their order (the last layer may then compute its outputs for them alone). A model
        built for a pipeline stage (`ModelOptions.pp`) also takes `intermediate`, the previous stage's
        IntermediateTensors (on every stage but the first), and returns its own on every stage but the last."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[R, hidden] -> [R, vocab]."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Consume (checkpoint name, tensor) pairs; returns the names of the parameters filled whole
        (a linear layer's parameters, shard by shard, are its own record: `LinearBase.missing_weights`)."""
        ...


@dataclass
class RoutedExperts:
    """A sparse layer's routed experts in the layout the fused CPU decode kernel reads: softmax router
    scores, greedy top-k, optional renormalisation, a scaling factor, no shared expert (Mixtral's block;
    layers.moe.route's `greedy` method with `softmax` scoring)."""

    router: torch.Tensor  # [experts, hidden] float32
    gate_up: list[LinearBase]  # one per expert, in expert order
    down: list[LinearBase]
    top_k: int
    norm_topk_prob: bool
    routed_scaling_factor: float


@dataclass
class DecoderLayerWeights:
    """One pre-norm decoder layer in the layout the fused CPU decode kernel reads: its MLP is either
    the dense SiLU-gated `gate_up`/`down` or, where they are None, the routed `experts`."""

    input_norm: torch.Tensor
    qkv: LinearBase
    o_proj: LinearBase
    post_norm: torch.Tensor
    gate_up: LinearBase | None
    down: LinearBase | None
    kv_cache: torch.Tensor  # the layer's bound [2, blocks, block_size, kv_heads, head_dim] cache
    kv_scales: KVScales | None = None  # a quantized cache's K and V scales (--kv-cache-dtype int8 / fp8_e4m3)
    experts: RoutedExperts | None = None


@dataclass
class DecoderLayout:
    """A Llama-shaped decoder (embedding, pre-norm GQA layers with SiLU-gated MLPs and full rotary,
    final RMSNorm, lm_head) described for the fused decode path (worker/fused_decode.py)."""

    embed: torch.Tensor
    layers: list[DecoderLayerWeights]
    final_norm: torch.Tensor
    lm_head: LinearBase
    cos: torch.Tensor
    sin: torch.Tensor
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    scale: float
    sliding_window: int | None


@runtime_checkable
class SupportsDecoderLayout(Protocol):
    def decoder_layout(self) -> DecoderLayout | None:
        """The model as a DecoderLayout, or None where it is not one (e.g. q/k norms, partial rotary)."""
        ...
