"""The BERT encoder as sentence-transformers checkpoints store it (`BertModel`, e.g.
all-MiniLM-L6-v2): word + position + token-type embeddings and a LayerNorm, then post-LN layers of
bidirectional self-attention and a GELU MLP. It has no KV cache and no language-model head: the
pooling runner (worker/pooling_runner.py) runs it over a right-padded batch and pools its hidden states.

q/k/v are fused into one projection; the checkpoint's query/key/value load into its shards.

In bfloat16 the projections' weights and products are bf16 (oneDNN's, AMX where there is one), and so are
q/k/v, the attention and the GELU's output, but the residual stream (embeddings, each sublayer's sum, the
LayerNorms) stays float32: the two projections that feed it (attention output, MLP output) widen their bf16
product to float32 and add a float32 bias. The whole model in bf16 rounds the residual stream at every layer
(bench/README.md, "Thirty-second session", has what each choice costs in cosine against float32)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.arch import ArchConfig
from tokenmill.layers.linear import (
    Embedding,
    Linear,
    LinearMethod,
    QKVLinear,
    ShardId,
    UnquantizedLinearMethod,
    linear_gelu,
    weight_loader_of,
)
from tokenmill.models.interface import ModelOptions

# transformers' ACT2FN names for the GELUs BERT checkpoints use
_GELU_APPROX = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": "tanh"}
_QKV = {"query": "q", "key": "k", "value": "v"}


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm without initialisation: every weight comes from the checkpoint."""

    def reset_parameters(self) -> None:
        return None


def residual_dtype(dtype: torch.dtype) -> torch.dtype:
    """The residual stream's dtype for a model in `dtype`: float32 under bfloat16 (the module docstring)."""
    return torch.float32 if dtype == torch.bfloat16 else dtype


class BertLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, opts: ModelOptions, residual_method: LinearMethod) -> None:
        """residual_method: the attention-output and MLP-output projections' (they feed the residual stream)."""
        super().__init__()
        h, method, hidden = cfg.hidden_size, opts.linear_method, residual_dtype(opts.dtype)
        self.dtype = opts.dtype
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.qkv_proj = QKVLinear(h, cfg.head_dim, cfg.num_heads, cfg.num_heads, True, opts.dtype, method)
        self.attn_out = Linear(cfg.num_heads * cfg.head_dim, h, True, hidden, residual_method)
        self.attn_norm = LayerNorm(h, eps=cfg.rms_norm_eps, dtype=hidden)
        self.intermediate = Linear(h, cfg.intermediate_size, True, opts.dtype, method)
        self.output = Linear(cfg.intermediate_size, h, True, hidden, residual_method)
        self.out_norm = LayerNorm(h, eps=cfg.rms_norm_eps, dtype=hidden)
        self.approximate = _GELU_APPROX[cfg.hidden_act]

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        """x [B, L, H] in the residual dtype; key_mask [B, 1, 1, L] bool, True at the real (not padding) tokens."""
        b, n, _ = x.shape
        qkv = self.qkv_proj(x.to(self.dtype)).view(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], attn_mask=key_mask)
        x = self.attn_norm(x + self.attn_out(o.transpose(1, 2).reshape(b, n, -1)))
        y = self.output(linear_gelu(self.intermediate, x.to(self.dtype), self.approximate))
        out: torch.Tensor = self.out_norm(x + y)
        return out


class BertModel(nn.Module):
    """Parameters are named as in the checkpoint (`embeddings.*`, `encoder.layer.N.*`), except the fused
    qkv_proj and the shorter names of each layer's sublayers (CHECKPOINT_NAMES)."""

    is_pooling_model = True

    def __init__(self, cfg: ArchConfig, opts: ModelOptions) -> None:
        super().__init__()
        if cfg.hidden_act not in _GELU_APPROX:
            raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported for BERT (one of "
                             f"{', '.join(sorted(_GELU_APPROX))})")
        self.cfg = cfg
        hidden = residual_dtype(opts.dtype)
        # the projections that feed the residual stream: bf16 weights and products under float32 sums where the
        # model is bf16, else the model's own method
        residual_method = (UnquantizedLinearMethod(weight_dtype=opts.dtype, bf16_products=True)
                           if hidden != opts.dtype else opts.linear_method)
        self.word_embeddings = Embedding(cfg.vocab_size, cfg.hidden_size, hidden)
        self.position_embeddings = Embedding(cfg.max_position_embeddings, cfg.hidden_size, hidden)
        self.token_type_embeddings = Embedding(max(cfg.type_vocab_size, 1), cfg.hidden_size, hidden)
        self.embed_norm = LayerNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=hidden)
        self.layers = nn.ModuleList(BertLayer(cfg, opts, residual_method) for _ in range(cfg.num_layers))

    def encode(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """input_ids [B, L], right-padded; lengths [B]. The hidden states [B, L, H] (padding rows
        are computed but attend to no padding and are not to be used). Token type 0 throughout."""
        n = input_ids.shape[1]
        positions = torch.arange(n, device=input_ids.device)
        x = (self.word_embeddings(input_ids) + self.position_embeddings(positions)[None]
             + self.token_type_embeddings.weight[0])
        x = self.embed_norm(x)
        key_mask = (positions[None, :] < lengths[:, None])[:, None, None, :]
        for layer in self.layers:
            x = layer(x, key_mask)
        return x

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for ckpt_name, tensor in weights:
            mapped = _our_name(ckpt_name.removeprefix("bert."))
            if mapped is None:
                continue  # the pooler head, position_ids buffers, an MLM head
            name, shard = mapped
            param = params.get(name)
            if param is None:
                continue
            try:
                weight_loader_of(param)(param, tensor, shard)
            except ValueError as e:
                raise ValueError(f"checkpoint tensor {ckpt_name!r}: {e}") from None
            loaded.add(name)
        return loaded


CHECKPOINT_NAMES = {"attention.output.dense": "attn_out", "attention.output.LayerNorm": "attn_norm",
                    "intermediate.dense": "intermediate", "output.dense": "output", "output.LayerNorm": "out_norm"}


def _our_name(name: str) -> tuple[str, ShardId] | None:
    if name.startswith("embeddings."):
        rest = name.removeprefix("embeddings.")
        return ("embed_norm." + rest.removeprefix("LayerNorm.") if rest.startswith("LayerNorm.") else rest), None
    if not name.startswith("encoder.layer."):
        return None
    index, _, rest = name.removeprefix("encoder.layer.").partition(".")
    sub, _, param = rest.rpartition(".")
    if sub.startswith("attention.self."):
        proj = sub.removeprefix("attention.self.")
        return (f"layers.{index}.qkv_proj.{param}", _QKV[proj]) if proj in _QKV else None
    if sub in CHECKPOINT_NAMES:
        return f"layers.{index}.{CHECKPOINT_NAMES[sub]}.{param}", None
    return None
