"""DeepSeek V2 / V3: multi-head latent attention (layers/mla.py) and DeepSeek's mixture of experts.

Attention: queries through q_proj, or the low-rank q_a_proj -> RMSNorm -> q_b_proj (q_lora_rank);
kv_a_proj_with_mqa gives the latent (RMS-normalised) and the rotary key; rope applies to the last
qk_rope_head_dim of each query head and to the shared key only (decoupled rope), interleaved pairs
(V2; V3 where `rope_interleave`) or two halves. yarn scales cos/sin by its attention factor and the
softmax by mscale(factor, mscale_all_dim) squared.

MLP: layers before `first_k_dense_replace` (and off `moe_layer_freq`) are dense; the others are a
`SparseMoeBlock` with DeepSeek's routing (softmax greedy / group-limited greedy for V2, sigmoid
noaux_tc with the score-correction bias for V3), `routed_scaling_factor`, and n_shared_experts
shared experts as one MLP added ungated.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from tokenmill.arch import ArchConfig
from tokenmill.arch_moe import MLAConfig
from tokenmill.attention.backend import AttentionMetadata, OutputRows
from tokenmill.layers.linear import Embedding, Linear, ShardId, weight_loader_of
from tokenmill.layers.mla import MLAAttention
from tokenmill.layers.moe import SparseMoeBlock
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import attention_factor, inv_frequencies, yarn_softmax_scale
from tokenmill.models.interface import ModelOptions
from tokenmill.models.llama import MLP
from tokenmill.models.moe import expert_checkpoint_names

LORA_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: the reference's RMSNorm default, not rms_norm_eps


class DecoupledRope(nn.Module):
    """Rotary embedding of the rope part of queries and of the shared rope key."""

    def __init__(self, cfg: ArchConfig, mla: MLAConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.interleave = mla.rope_interleave
        inv_freq = inv_frequencies(mla.qk_rope_head_dim, cfg.rope)
        freqs = torch.arange(cfg.max_position_embeddings, dtype=torch.float32, device="cpu")[:, None] * inv_freq
        scale = attention_factor(cfg.rope)
        device = torch.get_default_device()
        self.cos_cache: torch.Tensor
        self.sin_cache: torch.Tensor
        self.register_buffer("cos_cache", (freqs.cos() * scale).to(dtype=dtype, device=device), persistent=False)
        self.register_buffer("sin_cache", (freqs.sin() * scale).to(dtype=dtype, device=device), persistent=False)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [..., d_rope] with cos/sin broadcastable to [..., d_rope / 2]: the rotated pairs, first
        elements then second elements (the pairs' order is the same for queries and keys, so their
        dot products are those of the checkpoint's layout)."""
        if self.interleave:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def forward(self, positions: torch.Tensor, q_pe: torch.Tensor,
                k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q_pe [T, H, d_rope], k_pe [T, d_rope]."""
        cos, sin = self.cos_cache[positions], self.sin_cache[positions]
        return self.rotate(q_pe, cos[:, None], sin[:, None]), self.rotate(k_pe, cos, sin)


class KVBProj(nn.Module):
    """kv_b_proj's [H * (d_nope + d_v), kv_lora_rank] weight, kept unpacked: MLA reads it as per-head
    W_UK / W_UV matrices (absorbed into the query at decode), not as a linear layer."""

    def __init__(self, out_features: int, in_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)


class MLAttention(nn.Module):
    def __init__(self, cfg: ArchConfig, mla: MLAConfig, opts: ModelOptions) -> None:
        super().__init__()
        self.mla, self.num_heads = mla, cfg.num_heads
        dtype, method, bias, hidden = opts.dtype, opts.linear_method, cfg.attention_bias, cfg.hidden_size
        q_out = cfg.num_heads * mla.qk_head_dim
        self.q_proj: Linear | None = None
        self.q_a_proj: Linear | None = None
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: Linear | None = None
        if mla.q_lora_rank is None:
            self.q_proj = Linear(hidden, q_out, False, dtype, method)
        else:
            self.q_a_proj = Linear(hidden, mla.q_lora_rank, bias, dtype, method)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LORA_NORM_EPS)
            self.q_b_proj = Linear(mla.q_lora_rank, q_out, False, dtype, method)
        self.kv_a_proj_with_mqa = Linear(hidden, mla.latent_dim, bias, dtype, method)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LORA_NORM_EPS)
        self.kv_b_proj = KVBProj(cfg.num_heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank)
        self.o_proj = Linear(cfg.num_heads * mla.v_head_dim, hidden, bias, dtype, method)
        scale = mla.qk_head_dim ** -0.5 * yarn_softmax_scale(cfg.rope)
        self.attn = MLAAttention(cfg.num_heads, mla, scale)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: DecoupledRope, meta: AttentionMetadata,
                rows: OutputRows | None = None) -> torch.Tensor:
        m, t = self.mla, x.shape[0]
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(t, self.num_heads, m.qk_head_dim).split([m.qk_nope_head_dim, m.qk_rope_head_dim], -1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())
        q_pe, k_pe = rope(positions, q_pe, k_pe)
        out = self.attn.attend(q_nope, q_pe, latent, k_pe, self.kv_b_proj.weight, meta, rows)
        return self.o_proj(out)


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, mla: MLAConfig, opts: ModelOptions, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAttention(cfg, mla, opts)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        moe = cfg.moe
        self.mlp: nn.Module = (SparseMoeBlock(moe, cfg.hidden_size, opts.dtype, opts.linear_method)
                               if moe is not None and moe.sparse_layers[layer_idx] else MLP(cfg, opts))

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                rope: DecoupledRope, meta: AttentionMetadata,
                rows: OutputRows | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.self_attn(h, positions, rope, meta, rows)
        if rows is not None:
            residual = residual.index_select(0, rows.index)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class DeepseekForCausalLM(nn.Module):
    """Parameters are named as in HF checkpoints (without `model.`), except the fused gate_up_proj of
    every MLP and expert and `shared_expert` for DeepSeek's `shared_experts`."""

    def __init__(self, cfg: ArchConfig, opts: ModelOptions) -> None:
        super().__init__()
        if cfg.mla is None:
            raise ValueError(f"{cfg.architecture}: config.json describes no latent attention (kv_lora_rank)")
        if cfg.hidden_act != "silu":
            raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported (only silu)")
        self.cfg = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DeepseekDecoderLayer(cfg, cfg.mla, opts, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, False, opts.dtype,
                              opts.lm_head_method or opts.linear_method)
        self.rope = DecoupledRope(cfg, cfg.mla, opts.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                rows: OutputRows | None = None) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        residual = None
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            h, residual = layer(h, residual, positions, self.rope, meta, rows if i == last else None)
        h, _ = self.norm(h, residual)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.lm_head(hidden)
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for ckpt_name, tensor in expert_checkpoint_names(weights):
            name = ckpt_name.removeprefix("model.").replace(".shared_experts.", ".shared_expert.")
            shard: ShardId = None
            for part, shard_id in ((".gate_proj.", 0), (".up_proj.", 1)):
                if part in name:
                    name, shard = name.replace(part, ".gate_up_proj."), shard_id
            param = params.get(name)
            if param is None:
                continue  # e.g. V3's multi-token-prediction layers past num_hidden_layers
            try:
                weight_loader_of(param)(param, tensor, shard)
            except ValueError as e:
                raise ValueError(f"checkpoint tensor {ckpt_name!r}: {e}") from None
            loaded.add(name)
        if self.cfg.tie_word_embeddings and "lm_head.weight" not in loaded:
            self.lm_head.weight = self.embed_tokens.weight  # type: ignore[assignment]
            self.lm_head.tied_embedding = self.embed_tokens.take_panels
            self.lm_head.mark_loaded("weight")
            loaded.add("lm_head.weight")
        return loaded


