"""Gemma 2 and Gemma 3 (text): a decoder with sandwich norms (each sublayer's output normed before
the residual add, the MLP's input normed apart), (1 + weight) RMSNorms, GeGLU, the embedding scaled
by sqrt(hidden), queries scaled by query_pre_attn_scalar ** -0.5, and local (sliding window) and
global layers as `ArchConfig.layer_types` lists them. Gemma 2 soft-caps the attention scores and the
final logits; Gemma 3 norms q and k per head and gives its local layers a rope of their own.

Checkpoint names are HF's; q/k/v and gate/up are fused as in models/llama.py."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from tokenmill.arch import ArchConfig
from tokenmill.attention.backend import AttentionMetadata, OutputRows
from tokenmill.layers.activation import GeluAndMul
from tokenmill.layers.attention import PagedAttention
from tokenmill.layers.linear import Linear, MergedLinear, QKVLinear, embedding_for
from tokenmill.layers.norm import GemmaRMSNorm
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.models.interface import DecoderLayout, ModelOptions
from tokenmill.models.llama import load_decoder_weights


class GemmaAttention(nn.Module):
    def __init__(self, cfg: ArchConfig, opts: ModelOptions, layer: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        method = opts.linear_method
        self.qkv_proj = QKVLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads,
                                  cfg.attention_bias, opts.dtype, method)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, cfg.attention_bias, opts.dtype, method)
        self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        self.attn = PagedAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, scale, cfg.layer_window(layer),
                                   cfg.attn_logit_softcapping)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                meta: AttentionMetadata, rows: OutputRows | None = None) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v, meta, rows))


class GemmaMLP(nn.Module):
    def __init__(self, cfg: ArchConfig, opts: ModelOptions) -> None:
        super().__init__()
        i = cfg.intermediate_size
        self.gate_up_proj = MergedLinear(cfg.hidden_size, [i, i], False, opts.dtype, opts.linear_method)
        self.down_proj = Linear(i, cfg.hidden_size, False, opts.dtype, opts.linear_method)
        self.act = GeluAndMul(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, opts: ModelOptions, layer: int) -> None:
        super().__init__()
        # the sliding layers take the local rope where the family has one (Gemma 3)
        self.local = bool(cfg.layer_types) and cfg.layer_types[layer] == "sliding_attention"
        eps = cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.self_attn = GemmaAttention(cfg, opts, layer)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.mlp = GemmaMLP(cfg, opts)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)

    def forward(self, h: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding, meta: AttentionMetadata,
                rows: OutputRows | None = None) -> torch.Tensor:
        """h: the residual stream; with `rows`, the output is those rows' only."""
        x = self.self_attn(self.input_layernorm(h), positions, rotary, meta, rows)
        if rows is not None:
            h = h.index_select(0, rows.index)
        h = h + self.post_attention_layernorm(x)
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class GemmaForCausalLM(nn.Module):
    """Gemma2ForCausalLM and Gemma3ForCausalLM (text-only checkpoints). Parameters are named as in HF
    checkpoints (without the `model.` prefix), except the fused qkv_proj / gate_up_proj."""

    def __init__(self, cfg: ArchConfig, opts: ModelOptions) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = embedding_for(cfg.vocab_size, cfg.hidden_size, opts.dtype, opts.linear_method)
        self.embed_scale: torch.Tensor  # sqrt(hidden) rounded to the model's dtype, as transformers does
        self.register_buffer("embed_scale", torch.tensor(cfg.hidden_size**0.5, dtype=torch.float32).to(opts.dtype),
                             persistent=False)
        self.layers = nn.ModuleList(GemmaDecoderLayer(cfg, opts, i) for i in range(cfg.num_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, False, opts.dtype,
                              opts.lm_head_method or opts.linear_method)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope, opts.dtype)
        self.local_rotary = (RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.local_rope, opts.dtype)
                             if cfg.local_rope is not None else self.rotary)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                rows: OutputRows | None = None) -> torch.Tensor:
        h = self.embed_tokens(input_ids) * self.embed_scale
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            rotary = self.local_rotary if layer.local else self.rotary
            h = layer(h, positions, rotary, meta, rows if i == last else None)
        normed: torch.Tensor = self.norm(h)
        return normed

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.lm_head(hidden)
        cap = self.cfg.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_decoder_weights(self, weights, self.cfg.tie_word_embeddings)

    def decoder_layout(self) -> DecoderLayout | None:
        """None: the fused decode kernel runs pre-norm layers with SiLU MLPs and plain RMSNorms, not the
        sandwich norms, (1 + weight) norms, GeGLU, embedding scale and soft-capping of this family."""
        return None
