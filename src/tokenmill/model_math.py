"""Bytes and FLOPs of a decoder checkpoint, from its config.json shapes alone (no weights read).

Conventions (shared by `tokenmill plan` and `tokenmill bench latency`):
- params: every weight once; tied embeddings count once.
- matmul_params: the weights a token's forward multiplies by (everything but the embedding table,
  which is a row lookup; with tied embeddings the table is the lm_head, so it counts).
  FLOPs per token = 2 * matmul_params + attention (QK^T and PV: 4 * layers * heads * head_dim per
  position attended).
- decode_weight_bytes: the weights one decode step must stream: matmul_params plus one embedding row
  per sequence (untied) - the lm_head is read in full, the embedding table only where used.
- quantization (int8, w8a8, int4 with groups of 128): the decoder layers' projections (routed and shared
  experts' too) are stored as tokenmill holds them in memory (1 byte or half a byte per weight, K padded to
  64 for W8A8's kernel and to 32 for int4's, fp32 scales per output row or per
  row and group, int8's and W8A8's int32 row sums; int4 as `--quantization int4` makes it, symmetric, so
  without zero points); embeddings and norms stay float. The lm_head stays float too, except with
  lm_head_int8 (`--quantization int8|int4`): then it is int8 per output row with an fp32 scale and an int32 row
  sum, and a tied one keeps the float table for the embedding beside its int8 copy. W8A8 also keeps a
  oneDNN-packed int8 copy for large batches (a decode step does not read it), which these bytes leave out.
- Mixture of experts: params count every expert; matmul_params (FLOPs) only the k experts a token
  is routed to; decode_weight_bytes(batch) only the experts a step of `batch` tokens reads, expected
  under uniform routing: E * (1 - (1 - k/E)^batch) per sparse layer (k at batch 1), as the fused MoE
  path reads each chosen expert once per step and no other; the routers are float32 (4 bytes a weight
  whatever the dtype) and read whole every step.
- Multi-head latent attention: its projections as the checkpoint has them (q_a/q_b or q, kv_a,
  kv_b, o, the two low-rank norms); KV per token is the latent plus the rope key; attention FLOPs per
  position are the absorbed decode's (QK over latent + rope key, PV over the latent).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property

from tokenmill.arch import ArchConfig
from tokenmill.kv_cache_spec import DTYPE_BYTES, FLOAT_DTYPES, KV_SCALE_BYTES, QUANTIZED_KV_DTYPES
from tokenmill.quantization_config import INT4_K_ALIGN, RTN_INT4_GROUP, W8A8_K_ALIGN, round_up


def dtype_bytes(dtype: str) -> int:
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"dtype {dtype!r} unknown; choose from {', '.join(FLOAT_DTYPES)}")
    return DTYPE_BYTES[dtype]


QUANTIZED_FORMATS = ("int8", "w8a8", "int4")
INT4_GROUP = RTN_INT4_GROUP


@dataclass(frozen=True)
class ModelCost:
    arch: ArchConfig
    dtype: str
    kv_dtype: str | None = None  # the KV cache's storage dtype (kv_cache_spec.kv_storage_dtype); None: dtype
    quantization: str | None = None  # one of QUANTIZED_FORMATS: the projections' storage
    linear_dtype: str | None = None  # the projections', embedding's and lm_head's float storage where not dtype
    #                                  (bf16 weights under a float32 model: config.ModelConfig.linear_weight_dtype)
    lm_head_int8: bool = False  # the lm_head rounded to int8 per output row (quantization_config.QuantConfig.lm_head)
    # decode_weight_bytes by batch, as worked out (the fields above decide them; not part of the value)
    _decode_weight_bytes: dict[int, int] = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def elem_bytes(self) -> int:
        return dtype_bytes(self.dtype)

    @property
    def embedding_params(self) -> int:
        return self.arch.vocab_size * self.arch.hidden_size

    @property
    def lm_head_params(self) -> int:
        """The lm_head's own weights (0 when tied: the embedding table's are counted once, as the model holds them)."""
        return 0 if self.arch.tie_word_embeddings else self.embedding_params

    @property
    def head_matmul_params(self) -> int:
        """The weights the lm_head multiplies by, tied or not (one vocabulary matrix)."""
        return self.embedding_params

    @property
    def attention_params_per_layer(self) -> int:
        a = self.arch
        if a.mla is not None:
            return self._mla_params_per_layer
        q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        weights = a.hidden_size * (q + 2 * kv) + q * a.hidden_size
        bias = q + 2 * kv if a.attention_bias else 0
        qk_norm = 2 * a.head_dim if a.qk_norm else 0
        return weights + bias + qk_norm

    @property
    def _mla_params_per_layer(self) -> int:
        a, m = self.arch, self.arch.mla
        assert m is not None
        bias = a.attention_bias
        q_out = a.num_heads * m.qk_head_dim
        q = (a.hidden_size * q_out if m.q_lora_rank is None
             else a.hidden_size * m.q_lora_rank + m.q_lora_rank * (1 + bias) + m.q_lora_rank * q_out)
        kv = a.hidden_size * m.latent_dim + m.latent_dim * bias + m.kv_lora_rank  # kv_a (+ bias) and its norm
        kv += m.kv_lora_rank * a.num_heads * (m.qk_nope_head_dim + m.v_head_dim)  # kv_b
        o = a.num_heads * m.v_head_dim * a.hidden_size + a.hidden_size * bias
        return q + kv + o

    @property
    def mlp_params_per_layer(self) -> int:
        """A dense layer's MLP (gate, up, down)."""
        return 3 * self.arch.hidden_size * self.arch.intermediate_size

    @property
    def expert_params(self) -> int:
        """One routed expert's weights (0 without experts)."""
        moe = self.arch.moe
        return 0 if moe is None else 3 * self.arch.hidden_size * moe.intermediate_size

    @property
    def sparse_layers(self) -> int:
        return 0 if self.arch.moe is None else self.arch.moe.num_sparse_layers

    @property
    def _sparse_mlp_params_besides_experts(self) -> int:
        """A sparse layer's router, shared expert and its gate."""
        a, moe = self.arch, self.arch.moe
        assert moe is not None
        return (moe.num_experts * a.hidden_size + moe.num_experts * moe.score_correction_bias
                + 3 * a.hidden_size * moe.shared_intermediate_size + a.hidden_size * moe.shared_expert_gate)

    @property
    def mlp_params(self) -> int:
        """Every layer's MLP or MoE block, all experts counted."""
        a = self.arch
        dense = (a.num_layers - self.sparse_layers) * self.mlp_params_per_layer
        if a.moe is None:
            return dense
        return dense + self.sparse_layers * (a.moe.num_experts * self.expert_params
                                             + self._sparse_mlp_params_besides_experts)

    @cached_property
    def params(self) -> int:
        a = self.arch
        layers = a.num_layers * (self.attention_params_per_layer + a.norms_per_layer * a.hidden_size) + self.mlp_params
        return self.embedding_params + layers + a.hidden_size + self.lm_head_params

    def experts_read(self, batch: int) -> float:
        """Routed experts per sparse layer that a decode step of `batch` tokens reads (expected, under
        uniform routing); 0 without experts."""
        moe = self.arch.moe
        if moe is None:
            return 0.0
        e, k = moe.num_experts, moe.top_k
        return float(k) if batch == 1 else e * (1 - (1 - k / e) ** batch)

    def _unread_expert_params(self, experts_read: float) -> float:
        moe = self.arch.moe
        return 0.0 if moe is None else self.sparse_layers * (moe.num_experts - experts_read) * self.expert_params

    @cached_property
    def matmul_params(self) -> int:
        """Weights one token multiplies by: MoE layers count its k routed experts only."""
        k = 0 if self.arch.moe is None else self.arch.moe.top_k
        return round(self.params - (0 if self.arch.tie_word_embeddings else self.embedding_params)
                     - self._unread_expert_params(k))

    @property
    def active_params(self) -> int:
        """Parameters a token uses (its k experts; one embedding row)."""
        return self.matmul_params + (0 if self.arch.tie_word_embeddings else self.arch.hidden_size)

    @property
    def weight_bytes(self) -> int:
        """The bytes the weights hold, W8A8's second, oneDNN-packed copy left out (1 byte per projection
        weight and oneDNN's padding, which oneDNN's layout decides)."""
        return (self.params * self.elem_bytes - self.quantization_saving(held=True)
                - self.linear_dtype_saving(held=True) + self.float32_router_bytes)

    def _projection_shapes(self) -> list[tuple[int, int]]:
        """(rows, columns) of a decoder layer's qkv, o, gate/up and down projections."""
        a = self.arch
        q, kv, h, i = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.hidden_size, a.intermediate_size
        return [(q + 2 * kv, h), (h, q), (2 * i, h), (h, i)]

    def _projections(self, held: bool, batch: int = 1) -> list[tuple[float, list[tuple[int, int]]]]:
        """(how many, shapes) of the decoder's projections: every layer's qkv and o, each dense layer's MLP, and
        each sparse layer's routed experts (all of them in memory, held; else the ones a decode step of `batch`
        tokens reads, expected) and shared expert. The routers are no projection (float32, never quantized)."""
        a, moe = self.arch, self.arch.moe
        qkv, o, gate_up, down = self._projection_shapes()
        groups: list[tuple[float, list[tuple[int, int]]]] = [(a.num_layers, [qkv, o]),
                                                             (a.num_layers - self.sparse_layers, [gate_up, down])]
        if moe is not None:
            h, e, s = a.hidden_size, moe.intermediate_size, moe.shared_intermediate_size
            experts = moe.num_experts if held else self.experts_read(batch)
            groups.append((self.sparse_layers * experts, [(2 * e, h), (h, e)]))
            if s:
                groups.append((self.sparse_layers, [(2 * s, h), (h, s)]))
        return groups

    def decode_weight_bytes(self, batch: int = 1) -> int:
        """Weight bytes a decode step of `batch` tokens reads (worked out once per batch: the engine's step meter
        asks every step)."""
        known = self._decode_weight_bytes.get(batch)
        if known is None:
            known = self._decode_weight_bytes[batch] = self._weight_bytes_read(batch)
        return known

    def _weight_bytes_read(self, batch: int) -> int:
        rows = 0 if self.arch.tie_word_embeddings else batch * self.arch.hidden_size
        k = 0 if self.arch.moe is None else self.arch.moe.top_k
        extra = self._unread_expert_params(k) - self._unread_expert_params(self.experts_read(batch))
        return (round(self.matmul_params + extra + rows) * self.elem_bytes
                - self.quantization_saving(held=False, batch=batch) - self.linear_dtype_saving(held=False, batch=batch)
                + self.float32_router_bytes)

    @property
    def float32_router_bytes(self) -> int:
        """What the routers (and DeepSeek-V3's expert-choice bias) take beyond `elem_bytes` per weight:
        they are float32 whatever the model's dtype, and every decode step reads them whole."""
        moe = self.arch.moe
        if moe is None:
            return 0
        router = moe.num_experts * (self.arch.hidden_size + moe.score_correction_bias)
        return self.sparse_layers * router * max(0, 4 - self.elem_bytes)

    @property
    def matmul_weight_bytes(self) -> int:
        """The bytes of the weights one token multiplies by (matmul_params), as they are stored (quantized or
        bf16-stored projections counted so)."""
        return (self.matmul_params * self.elem_bytes - self.quantization_saving(held=False)
                - self.linear_dtype_saving(held=False))

    def linear_dtype_saving(self, held: bool, batch: int = 1) -> int:
        """Bytes the projections (routed experts' and shared experts' included; not the float32 routers),
        embedding table and lm_head stored in linear_dtype save over dtype (0 without one): in memory (held), or
        read by a decode step of `batch` tokens (the projections, the experts it reads, and the one vocabulary
        matrix the lm_head multiplies by: a tied one is the embedding table)."""
        if self.linear_dtype is None or self.quantization is not None:
            return 0
        projections = round(sum(n * sum(r * c for r, c in shapes) for n, shapes in self._projections(held, batch)))
        vocab = self.embedding_params + self.lm_head_params if held else self.head_matmul_params
        return (projections + vocab) * (self.elem_bytes - dtype_bytes(self.linear_dtype))

    def quantization_saving(self, held: bool = True, batch: int = 1) -> int:
        """Bytes the quantized projections (routed and shared experts' included) save over float ones (0
        unquantized): in memory (held), or read by a decode step of `batch` tokens (the experts it reads)."""
        if self.quantization is None:
            return 0
        if self.quantization not in QUANTIZED_FORMATS:
            raise ValueError(f"quantization {self.quantization!r} unknown; choose from {QUANTIZED_FORMATS}")

        def saving(rows: int, cols: int) -> int:  # (with the kernels' padded K)
            if self.quantization == "int4":
                held_bytes = rows * round_up(cols, INT4_K_ALIGN) // 2 + rows * -(-cols // INT4_GROUP) * 4
            else:
                held_bytes = rows * (round_up(cols, W8A8_K_ALIGN) if self.quantization == "w8a8" else cols) + rows * 8
            return rows * cols * self.elem_bytes - held_bytes

        groups = self._projections(held, batch)
        projections = round(sum(n * sum(saving(r, c) for r, c in shapes) for n, shapes in groups))
        if not self.lm_head_int8:
            return projections
        vocab, hidden = self.arch.vocab_size, self.arch.hidden_size
        int8_head = vocab * hidden + vocab * 8
        if held and self.arch.tie_word_embeddings:  # the int8 copy beside the embedding's float table
            return projections - int8_head
        return projections + vocab * hidden * self.elem_bytes - int8_head

    @cached_property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers, as the pool stores them (a quantized cache: one element
        byte per value plus a float32 scale per token and kv head, as FullAttentionSpec counts them)."""
        kv = self.kv_dtype or self.dtype
        if kv in QUANTIZED_KV_DTYPES:
            a = self.arch
            return 2 * a.num_layers * a.num_kv_heads * (a.head_dim * DTYPE_BYTES[kv] + KV_SCALE_BYTES)
        return self.arch.kv_bytes_per_token * dtype_bytes(kv)

    @property
    def full_kv_bytes_per_token(self) -> int:
        """KV bytes per token of the same model caching full per-head K and V (MLA: decompressed keys
        of qk_nope + qk_rope and values of v_head_dim per head; otherwise kv_bytes_per_token)."""
        a = self.arch
        if a.mla is None:
            return self.kv_bytes_per_token
        return a.num_layers * a.num_heads * (a.mla.qk_head_dim + a.mla.v_head_dim) * self.elem_bytes

    @cached_property
    def attn_flops_per_position(self) -> int:
        """FLOPs one query token spends per position it attends to (QK^T plus PV, all layers)."""
        a = self.arch
        if a.mla is not None:
            return 2 * a.num_layers * a.num_heads * (2 * a.mla.kv_lora_rank + a.mla.qk_rope_head_dim)
        return 4 * a.num_layers * a.num_heads * a.head_dim

    def decode_bytes(self, batch: int, context: int) -> int:
        """Bytes one decode step of `batch` sequences reads, each holding `context` tokens of KV."""
        return self.decode_weight_bytes(batch) + batch * context * self.kv_bytes_per_token

    def decode_flops(self, batch: int, context: int) -> int:
        return batch * (2 * self.matmul_params + self.attn_flops_per_position * context)

    def prefill_flops_per_token(self, prompt_len: int) -> float:
        """Average FLOPs per prompt token of a causal prefill of `prompt_len` tokens. The lm_head
        runs once per prompt (only the last position is sampled), not once per token."""
        body = self.matmul_params - self.head_matmul_params
        return (2 * body + 2 * self.head_matmul_params / prompt_len
                + self.attn_flops_per_position * (prompt_len + 1) / 2)

    def request_flops(self, prompt_len: int, output_len: int) -> float:
        """FLOPs a request needs with nothing cached: its prompt's prefill (which gives the first output
        token), then output_len - 1 decode steps."""
        decodes, attended = decode_positions(prompt_len, output_len)
        return (prompt_len * self.prefill_flops_per_token(prompt_len)
                + decodes * 2 * self.matmul_params + self.attn_flops_per_position * attended)

    def request_kv_bytes(self, prompt_len: int, output_len: int) -> int:
        """The KV bytes a request's steps move at the least: its prompt's once, then each decode step's
        whole context."""
        return (prompt_len + decode_positions(prompt_len, output_len)[1]) * self.kv_bytes_per_token

    def crossover_batch(self, context: int, bandwidth_gbps: float, gflops: float) -> float | None:
        """The batch size where a decode step turns compute-bound, or None if it never does
        (KV traffic then grows as fast as compute)."""
        per_seq_flops = 2 * self.matmul_params + self.attn_flops_per_position * context
        per_seq_bytes = context * self.kv_bytes_per_token + (
            0 if self.arch.tie_word_embeddings else self.arch.hidden_size * self.elem_bytes)
        ratio = bandwidth_gbps / gflops  # bytes moved per flop at the balance point
        denom = per_seq_flops * ratio - per_seq_bytes
        if denom <= 0:
            return None
        return self.matmul_weight_bytes / denom


def decode_positions(prompt_len: int, output_len: int) -> tuple[int, int]:
    """A request's decode steps (output_len - 1: prefill gives the first token) and the positions they
    attend to in all: the i-th step attends to prompt_len + i."""
    decodes = max(0, output_len - 1)
    return decodes, decodes * prompt_len + decodes * (decodes + 1) // 2


@dataclass(frozen=True)
class DecodeFloor:
    batch: int
    bytes: int
    flops: int
    memory_s: float
    compute_s: float

    @property
    def floor_s(self) -> float:
        return max(self.memory_s, self.compute_s)

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s > self.memory_s else "memory"

    @property
    def tok_s(self) -> float:
        return self.batch / self.floor_s if self.floor_s > 0 else math.inf


def decode_floor(cost: ModelCost, batch: int, context: int, bandwidth_gbps: float, gflops: float) -> DecodeFloor:
    nbytes, flops = cost.decode_bytes(batch, context), cost.decode_flops(batch, context)
    return DecodeFloor(batch, nbytes, flops, nbytes / (bandwidth_gbps * 1e9), flops / (gflops * 1e9))


def kv_capacity(kv_budget_bytes: int, cost: ModelCost, block_size: int) -> int:
    """Tokens of KV that fit in a budget, counted in whole blocks as the engine allocates them."""
    return max(0, kv_budget_bytes // (cost.kv_bytes_per_token * block_size)) * block_size


def max_requests(capacity_tokens: int, context: int, block_size: int) -> int:
    return (capacity_tokens // block_size) // math.ceil(context / block_size)
