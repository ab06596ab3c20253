"""The Llama family as one decoder: Llama (GQA, llama3 rope, tied embeddings), Mistral
(sliding window), Qwen2 (qkv bias), Qwen3 (q/k RMSNorm) and Phi-3 (longrope, partial rotary) differ
only in ArchConfig flags.

q/k/v and gate/up projections are fused (one matmul each); the checkpoint's separate projections load
into their shards, and Phi-3's fused ones are split into them (`load_fused`).

Under tensor parallelism (`ModelOptions.tp`) q/k/v and gate/up are column-parallel (each rank its
heads, its KV heads, its share of the intermediate rows), o_proj and down row-parallel (summed over
the ranks), the embedding and lm_head split by vocabulary (the logits gathered); each rank's
PagedAttention, and so its KV cache, holds its own KV heads only.

Under pipeline parallelism (`ModelOptions.pp`) a stage builds only its contiguous range of layers, the
first stage the embedding, the last the final norm and lm_head (with tied embeddings the last stage loads
the embedding's tensor into its lm_head); the others are PPMissingLayer placeholders, which keep the
layers' names (and so the checkpoint's) and hold nothing. A stage's forward takes the previous stage's
IntermediateTensors and returns its own, but the last, which returns the final hidden states."""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import torch
from torch import nn

from tokenmill.arch import ArchConfig
from tokenmill.attention.backend import AttentionMetadata, OutputRows
from tokenmill.layers.activation import SiluAndMul
from tokenmill.layers.attention import PagedAttention
from tokenmill.layers.linear import (
    ColumnParallelLinear,
    Embedding,
    LinearBase,
    MergedLinear,
    QKVLinear,
    RowParallelLinear,
    ShardId,
    embedding_for,
    weight_loader_of,
)
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.parallel import PPMissingLayer, VocabParallelEmbedding
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.models.interface import DecoderLayerWeights, DecoderLayout, IntermediateTensors, ModelOptions

# checkpoint projection -> (our fused parameter's module, shard id)
STACKED: dict[str, tuple[str, ShardId]] = {
    "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def load_fused(layer: LinearBase, param: nn.Parameter, tensor: torch.Tensor) -> None:
    """A checkpoint tensor of a whole fused projection (q/k/v, or gate/up, stacked along the output
    dimension), loaded shard by shard through the layer's weight loader (which takes its rank's part)."""
    if tensor.shape[0] != sum(layer.checkpoint_sizes):
        raise ValueError(f"tensor shape {list(tensor.shape)} does not match the model's "
                         f"{[sum(layer.checkpoint_sizes), *param.shape[1:]]}")
    start = 0
    for shard_id, size in zip(layer.shard_ids, layer.checkpoint_sizes, strict=True):
        weight_loader_of(param)(param, tensor[start:start + size], shard_id)
        start += size


class Attention(nn.Module):
    def __init__(self, cfg: ArchConfig, opts: ModelOptions) -> None:
        super().__init__()
        tp, method = opts.tp, opts.linear_method
        self.qkv_proj = QKVLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads,
                                  cfg.attention_bias, opts.dtype, method, tp)
        # this rank's heads (all of them on one rank)
        self.num_heads, self.num_kv_heads = tp.split(cfg.num_heads), tp.kv_heads(cfg.num_kv_heads)[1]
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, False, opts.dtype, method, tp)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, cfg.head_dim, cfg.head_dim**-0.5,
                                   cfg.sliding_window)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                meta: AttentionMetadata, rows: OutputRows | None = None) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v, meta, rows))


class MLP(nn.Module):
    def __init__(self, cfg: ArchConfig, opts: ModelOptions) -> None:
        super().__init__()
        if cfg.hidden_act != "silu":
            raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported (only silu)")
        i = cfg.intermediate_size
        self.gate_up_proj = MergedLinear(cfg.hidden_size, [i, i], False, opts.dtype, opts.linear_method, opts.tp)
        self.down_proj = RowParallelLinear(i, cfg.hidden_size, False, opts.dtype, opts.linear_method, opts.tp)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        fused = self.down_proj.gated_forward(gate_up)  # the activation in the down projection's GEMV, on a GPU
        return fused if fused is not None else self.down_proj(self.act(gate_up))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, opts: ModelOptions, layer_idx: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, opts)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = self.build_mlp(cfg, opts, layer_idx)

    def build_mlp(self, cfg: ArchConfig, opts: ModelOptions, layer_idx: int) -> nn.Module:
        """The layer's feed-forward block (a subclass may return another, e.g. a sparse MoE block)."""
        return MLP(cfg, opts)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                rotary: RotaryEmbedding, meta: AttentionMetadata,
                rows: OutputRows | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """h is the previous sublayer's output, not yet added to the residual stream. With `rows`,
        the outputs are those rows' only (all rows' K/V are still cached)."""
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.self_attn(h, positions, rotary, meta, rows)
        if rows is not None:
            residual = residual.index_select(0, rows.index)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    """Parameters are named as in HF checkpoints (without the `model.` prefix), except the fused
    qkv_proj / gate_up_proj."""

    decoder_layer: type[DecoderLayer] = DecoderLayer

    def __init__(self, cfg: ArchConfig, opts: ModelOptions) -> None:
        super().__init__()
        self.cfg = cfg
        self.tp = tp = opts.tp
        self.pp = pp = opts.pp
        self.stage_layers = pp.layers(cfg.num_layers)
        self.embed_tokens: Embedding | VocabParallelEmbedding | PPMissingLayer = (
            PPMissingLayer() if not pp.is_first
            else embedding_for(cfg.vocab_size, cfg.hidden_size, opts.dtype, opts.linear_method) if tp.size == 1
            else VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp))
        self.layers = nn.ModuleList(self.decoder_layer(cfg, opts, i) if i in self.stage_layers else PPMissingLayer()
                                    for i in range(cfg.num_layers))
        self.norm: RMSNorm | PPMissingLayer = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if pp.is_last \
            else PPMissingLayer()
        self.lm_head: ColumnParallelLinear | PPMissingLayer = (
            ColumnParallelLinear(cfg.hidden_size, cfg.vocab_size, False, opts.dtype,
                                 opts.lm_head_method or opts.linear_method, tp, padded=True)
            if pp.is_last else PPMissingLayer())
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope, opts.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                rows: OutputRows | None = None,
                intermediate: IntermediateTensors | None = None) -> torch.Tensor | IntermediateTensors:
        if self.pp.is_first:
            h, residual = self.embed_tokens(input_ids), None
        else:
            if intermediate is None:
                raise ValueError("a pipeline stage after the first needs the previous stage's hidden states")
            h, residual = intermediate.hidden, intermediate.residual
        last = len(self.layers) - 1
        for i in self.stage_layers:
            h, residual = self.layers[i](h, residual, positions, self.rotary, meta, rows if i == last else None)
        assert residual is not None  # (every stage holds at least one layer)
        if not self.pp.is_last:
            return IntermediateTensors(h, residual)
        h, _ = self.norm(h, residual)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.lm_head(hidden)
        if self.tp.size > 1:  # every rank's vocabulary rows, the padding past the vocabulary dropped
            logits = self.tp.all_gather(logits)[..., :self.cfg.vocab_size]
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_decoder_weights(self, weights, self.cfg.tie_word_embeddings)

    def describe_mlp(self, mlp: nn.Module, weights: DecoderLayerWeights) -> bool:
        """Fill `weights`' MLP fields from a layer's MLP; False where the fused path cannot run it (it runs
        dense SiLU-gated MLPs, and the routed experts a subclass describes)."""
        if not isinstance(mlp, MLP):
            return False
        weights.gate_up, weights.down = mlp.gate_up_proj, mlp.down_proj
        return True

    def decoder_layout(self) -> DecoderLayout | None:
        cfg = self.cfg
        if cfg.qk_norm or self.rotary.rot_dim != cfg.head_dim or self.tp.size > 1 or self.pp.size > 1:
            # (the fused C++ decode loop has no collectives and runs the whole stack: tensor and pipeline
            # parallel ranks run the layer loop)
            return None
        layers = []
        for layer in cast(list[DecoderLayer], list(self.layers)):
            attn = layer.self_attn
            weights = DecoderLayerWeights(layer.input_layernorm.weight, attn.qkv_proj, attn.o_proj,
                                          layer.post_attention_layernorm.weight, None, None, attn.attn.kv_cache,
                                          attn.attn.kv_scales)
            if not self.describe_mlp(layer.mlp, weights):
                return None
            layers.append(weights)
        assert isinstance(self.norm, RMSNorm) and isinstance(self.lm_head, ColumnParallelLinear)
        assert not isinstance(self.embed_tokens, PPMissingLayer)
        return DecoderLayout(self.embed_tokens.weight, layers, self.norm.weight, self.lm_head,
                             self.rotary.cos_cache, self.rotary.sin_cache, cfg.num_heads, cfg.num_kv_heads,
                             cfg.head_dim, cfg.rms_norm_eps, cfg.head_dim**-0.5, cfg.sliding_window)


def load_decoder_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], tied: bool) -> set[str]:
    """HF decoder checkpoint names onto a model whose parameters are named alike (without `model.`),
    q/k/v and gate/up fused, and with `embed_tokens` and `lm_head` (one tensor for both where `tied`)."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    # a pipeline stage with the lm_head but not the embedding (the last of several) loads the tied tensor
    # into its lm_head; one with both ties them below; one with neither, or only the embedding, ties nothing
    head_takes_embedding = tied and "lm_head.weight" in params and "embed_tokens.weight" not in params
    tie = tied and "lm_head.weight" in params and "embed_tokens.weight" in params
    for ckpt_name, tensor in weights:
        name = ckpt_name.removeprefix("model.")
        if tied and name == "lm_head.weight":
            continue
        if head_takes_embedding and name == "embed_tokens.weight":
            name = "lm_head.weight"
        shard: ShardId = None
        for part, (fused, shard_id) in STACKED.items():
            if f".{part}." in name:
                name, shard = name.replace(f".{part}.", f".{fused}."), shard_id
                break
        param = params.get(name)
        if param is None:
            continue  # tensors this model has no use for (e.g. rotary inv_freq buffers)
        try:
            if shard is None and isinstance(module := model.get_submodule(name.rpartition(".")[0]),
                                            (QKVLinear, MergedLinear)):
                load_fused(module, param, tensor)  # a checkpoint that fuses them too (Phi-3)
            else:
                weight_loader_of(param)(param, tensor, shard)
        except ValueError as e:
            raise ValueError(f"checkpoint tensor {ckpt_name!r}: {e}") from None
        loaded.add(name)
    if tie:  # one tensor for both (until a linear method repacks the lm_head's)
        lm_head, embed = cast(LinearBase, model.get_submodule("lm_head")), model.get_submodule("embed_tokens")
        lm_head.weight = cast(nn.Parameter, embed.weight)
        if isinstance(embed, Embedding):
            lm_head.tied_embedding = embed.take_panels
        lm_head.mark_loaded("weight")
        loaded.add("lm_head.weight")
    return loaded
