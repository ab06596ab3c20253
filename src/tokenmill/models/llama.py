"""The Llama family as one decoder: Llama (GQA, llama3 rope, tied embeddings), Mistral
(sliding window), Qwen2 (qkv bias) and Qwen3 (q/k RMSNorm) differ only in ArchConfig flags.

q/k/v and gate/up projections are fused at load time (one matmul each)."""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.attention.backend import AttentionBackend, AttentionMetadata, OutputRows, write_kv
from tokenmill.layers.linear import Embedding, Linear, PackedLinear
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.arch import ArchConfig


class Attention(nn.Module):
    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = self.head_dim**-0.5
        self.ops: Any = None  # tokenmill's C++ CPU kernels, when the runner enables them

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                kv_cache: torch.Tensor, meta: AttentionMetadata, backend: AttentionBackend,
                rows: OutputRows | None = None) -> torch.Tensor:
        """Every row's K/V go to the cache; the output is every row's, or with `rows` only theirs."""
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(positions, q, k)
        if self.ops is not None:
            self.ops.write_kv_(k, v, kv_cache[0], kv_cache[1], meta.slot_mapping)
        else:
            write_kv(k, v, kv_cache[0], kv_cache[1], meta.slot_mapping)
        if rows is not None:
            q, k, v = (y.index_select(0, rows.index) for y in (q, k, v))
            meta = rows.meta
            t = q.shape[0]
        o = backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.o_proj(o.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        if cfg.hidden_act != "silu":
            raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported (only silu)")
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

        self.ops: Any = None  # tokenmill's C++ CPU kernels, when the runner enables them

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.ops is not None and gate_up.dtype == torch.bfloat16:
            return self.down_proj(self.ops.silu_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                rotary: RotaryEmbedding, kv_cache: torch.Tensor, meta: AttentionMetadata,
                backend: AttentionBackend, rows: OutputRows | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """h is the previous sublayer's output, not yet added to the residual stream. With `rows`,
        the outputs are those rows' only (all rows' K/V are still cached)."""
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.self_attn(h, positions, rotary, kv_cache, meta, backend, rows)
        if rows is not None:
            residual = residual.index_select(0, rows.index)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    """Weights are named as in HF checkpoints, except the fused qkv_proj / gate_up_proj."""

    def __init__(self, cfg: ArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope, dtype)
        self.ops: Any = None
        self._layer_weights: list[torch.Tensor] | None = None  # for ops.decode_layers, when it applies
        self._gemv_ptrs = torch.empty(0, dtype=torch.int64)
        self._decode_static: tuple[Any, ...] = ()
        self._embed_weight: torch.Tensor | None = None
        self._lm_head_args: tuple[Any, ...] | None = None  # for ops.decode_greedy, where the lm_head is packed

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata, backend: AttentionBackend, rows: OutputRows | None = None) -> torch.Tensor:
        """The final hidden states of every row, or with `rows` of those rows only (in their order):
        then the last layer computes its attention output and MLP for them alone."""
        h = self.embed_tokens(input_ids)
        if rows is None and self.fused_decode(meta, h.shape[0]):
            # a pure-decode step: the same kernels as the loop below, called from C++
            return self.ops.decode_layers(h, positions, *self._decode_args(kv_caches, meta))
        residual = None
        last = len(self.layers) - 1
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            h, residual = layer(h, residual, positions, self.rotary, kv_cache, meta, backend,
                                rows if i == last else None)
        h, _ = self.norm(h, residual)
        return h

    def fused_decode(self, meta: AttentionMetadata, rows: int) -> bool:
        """Whether this step is one ops.decode_layers takes: pure decode, the C++ attention's tables."""
        return self._layer_weights is not None and meta.num_decodes == rows and "decode_tables" in meta.extra

    def _decode_args(self, kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> tuple[Any, ...]:
        cos, sin, weights, ptrs, norm, heads, kv_heads, head_dim, eps, scale = self._decode_static
        return (cos, sin, weights, ptrs, norm, kv_caches, meta.slot_mapping, meta.extra["decode_tables"],
                meta.extra["decode_lens"], heads, kv_heads, head_dim, eps, scale, meta.sliding_window or 0, True)

    def decode_greedy(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                      meta: AttentionMetadata) -> torch.Tensor | None:
        """A pure-decode step whose every row is plain greedy, to its tokens, in one C++ call
        (ops.decode_greedy: embedding, decode_layers, lm_head, the sampler's argmax kernel); the same
        kernels as forward + compute_logits + Sampler.argmax, so the same tokens. None where it does
        not apply (the caller takes that path then)."""
        if self._lm_head_args is None or not self.fused_decode(meta, input_ids.shape[0]):
            return None
        ids: torch.Tensor = self.ops.decode_greedy(input_ids, self._embed_weight, positions,
                                                   *self._decode_args(kv_caches, meta), *self._lm_head_args)
        return ids

    def enable_fused_ops(self, ops: Any, decode_layers: bool = True) -> None:
        """Route bf16 norms, rotary, SiLU-and-mul and KV-cache writes through fused C++ kernels; and,
        where every projection is packed (and takes the GEMV where PackedLinear would), run
        pure-decode steps through ops.decode_layers (the whole layer loop in one call)."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, RotaryEmbedding, MLP, Attention)):
                module.ops = ops
        self.ops = ops
        self._layer_weights = self._decode_layer_weights() if decode_layers else None
        # what every fused decode call passes, gathered once: module attribute lookups cost ~1 us each
        cfg = self.cfg
        self._decode_static = (self.rotary.cos_cache, self.rotary.sin_cache, self._layer_weights, self._gemv_ptrs,
                               self.norm.weight, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps,
                               cfg.head_dim**-0.5)
        self._embed_weight = self.embed_tokens.weight
        lm_head = self.lm_head
        self._lm_head_args = None
        if isinstance(lm_head, PackedLinear):
            self._lm_head_args = (lm_head.weight, lm_head.bias, lm_head.gemv_ops is not None, lm_head.gemv_data_ptr())

    def _decode_layer_weights(self) -> list[torch.Tensor] | None:
        cfg = self.cfg
        if cfg.qk_norm or self.rotary.rot_dim != cfg.head_dim or self.rotary.cos_cache.dtype != torch.bfloat16:
            return None
        weights: list[torch.Tensor] = []
        ptrs: list[int] = []  # the packed projections' addresses, for the GEMV decode_layers calls
        for layer in cast(list[DecoderLayer], list(self.layers)):
            attn, mlp = layer.self_attn, layer.mlp
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if not all(isinstance(m, PackedLinear) and m.gemv_ops is not None for m in linears):
                return None
            qkv_bias = attn.qkv_proj.bias if attn.qkv_proj.bias is not None else self.norm.weight.new_empty(0)
            weights += [layer.input_layernorm.weight, attn.qkv_proj.weight, qkv_bias, attn.o_proj.weight,
                        layer.post_attention_layernorm.weight, mlp.gate_up_proj.weight, mlp.down_proj.weight]
            ptrs += [cast(PackedLinear, m).gemv_data_ptr() for m in linears]
        self._gemv_ptrs = torch.tensor(ptrs, dtype=torch.int64)
        return weights

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    @staticmethod
    def checkpoint_name_map(name: str) -> tuple[str, str | None]:
        """HF weight name -> (our parameter name, shard id of a fused parameter or None)."""
        name = name.removeprefix("model.")
        for part, fused in (("q_proj", "qkv_proj"), ("k_proj", "qkv_proj"), ("v_proj", "qkv_proj"),
                            ("gate_proj", "gate_up_proj"), ("up_proj", "gate_up_proj")):
            if f".{part}." in name:
                return name.replace(f".{part}.", f".{fused}."), part
        return name, None
