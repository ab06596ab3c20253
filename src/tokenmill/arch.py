"""The torch-free description of the architectures tokenmill runs: `ArchConfig` (read from a
checkpoint's config.json), `RopeConfig`, and the registry of architectures.

`core/`, `config.py`, `layers/` and `bench/` import this module without importing `models/`: the
registry names each model class by its dotted path, imported only by `model_class`.

Both config dialects are understood: transformers 4 (`torch_dtype`, top-level `rope_theta`,
`rope_scaling`) and transformers 5 (`dtype`, `rope_parameters`).
"""

from __future__ import annotations

import importlib
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from tokenmill.arch_moe import MLAConfig, MoEConfig, parse_mla, parse_moe


@dataclass(frozen=True)
class ArchSpec:
    """One registered architecture: where its model class lives, and the config.json defaults that
    its checkpoints may leave out."""

    model_class: str  # "module:Class", imported lazily
    defaults: dict[str, Any] = field(default_factory=dict)
    runner: str = "generate"  # the runner its checkpoints get by default: generate | pooling (embeddings)


ARCHITECTURES: dict[str, ArchSpec] = {
    "LlamaForCausalLM": ArchSpec("tokenmill.models.llama:LlamaForCausalLM", {"attention_bias": False}),
    "MistralForCausalLM": ArchSpec("tokenmill.models.llama:LlamaForCausalLM", {"attention_bias": False}),
    "Qwen2ForCausalLM": ArchSpec("tokenmill.models.llama:LlamaForCausalLM", {"attention_bias": True}),
    "Qwen3ForCausalLM": ArchSpec("tokenmill.models.llama:LlamaForCausalLM",
                                 {"attention_bias": False, "qk_norm": True}),
    "Phi3ForCausalLM": ArchSpec("tokenmill.models.llama:LlamaForCausalLM", {"attention_bias": False}),
    # Gemma: sliding_window_pattern is the transformers-4 dialect's layer rule (every n-th layer global)
    "Gemma2ForCausalLM": ArchSpec("tokenmill.models.gemma:GemmaForCausalLM",
                                  {"attention_bias": False, "sliding_window_pattern": 2, "norms_per_layer": 4,
                                   "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0,
                                   "query_pre_attn_scalar": 256, "hidden_activation": "gelu_pytorch_tanh"}),
    "Gemma3ForCausalLM": ArchSpec("tokenmill.models.gemma:GemmaForCausalLM",
                                  {"attention_bias": False, "qk_norm": True, "sliding_window_pattern": 6,
                                   "norms_per_layer": 4,
                                   "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
                                   "query_pre_attn_scalar": 256,
                                   "hidden_activation": "gelu_pytorch_tanh"}),
    "MixtralForCausalLM": ArchSpec("tokenmill.models.moe:MoEForCausalLM", {"attention_bias": False}),
    "Qwen2MoeForCausalLM": ArchSpec("tokenmill.models.moe:MoEForCausalLM", {"attention_bias": True}),
    "Qwen3MoeForCausalLM": ArchSpec("tokenmill.models.moe:MoEForCausalLM",
                                    {"attention_bias": False, "qk_norm": True}),
    "DeepseekV2ForCausalLM": ArchSpec("tokenmill.models.deepseek:DeepseekForCausalLM", {"attention_bias": False}),
    "DeepseekV3ForCausalLM": ArchSpec("tokenmill.models.deepseek:DeepseekForCausalLM", {"attention_bias": False}),
    # the BERT encoder as sentence-transformers checkpoints store it (no MLM or pooler head used)
    "BertModel": ArchSpec("tokenmill.models.bert:BertModel", {"attention_bias": True, "hidden_act": "gelu"},
                          runner="pooling"),
}
RUNNERS = ("generate", "pooling")


def _unsupported(arch: object) -> ValueError:
    return ValueError(f"architecture {arch!r} is not supported; supported: {', '.join(sorted(ARCHITECTURES))}")


def model_class(architecture: str) -> type:
    """The model class registered for an architecture (its module is imported here)."""
    if architecture not in ARCHITECTURES:
        raise _unsupported(architecture)
    module, name = ARCHITECTURES[architecture].model_class.split(":")
    cls: type = getattr(importlib.import_module(module), name)
    return cls


ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"  # one of ROPE_TYPES
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    partial_rotary_factor: float = 1.0
    # longrope (Phi-3): per-frequency divisors below / from original_max_position_embeddings
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    # yarn: the ramp between interpolated and extrapolated frequencies
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    truncate: bool = True
    # the factor cos and sin are multiplied by (longrope, yarn); None: the schedule's own rule
    attention_factor: float | None = None


@dataclass(frozen=True)
class ArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float  # the norms' epsilon (config.json's layer_norm_eps in LayerNorm families)
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    sliding_window: int | None
    hidden_act: str
    dtype: str | None  # the checkpoint's dtype as written, e.g. "bfloat16"
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    bos_token_id: int | None = None
    # Gemma: per-layer "sliding_attention" / "full_attention" (empty: every layer alike), the rope of
    # the sliding layers where it differs, tanh soft-capping of the final logits and the attention
    # scores, and the query scaling's denominator (scale = query_pre_attn_scalar ** -0.5)
    layer_types: tuple[str, ...] = ()
    local_rope: RopeConfig | None = None
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    query_pre_attn_scalar: float | None = None
    norms_per_layer: int = 2  # hidden-size RMSNorms in a decoder layer (Gemma's sandwich: 4)
    moe: MoEConfig | None = None  # routed experts (arch_moe.py), None for dense families
    mla: MLAConfig | None = None  # latent attention (arch_moe.py): the cache holds latents, not K and V
    type_vocab_size: int = 0  # token-type (segment) embeddings of encoder families
    matryoshka_dimensions: tuple[int, ...] | None = None  # embedding sizes it was trained to truncate to
    pad_token_id: int | None = None

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of one layer (None: it attends to the whole context)."""
        if self.layer_types and self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    @property
    def default_runner(self) -> str:
        return ARCHITECTURES[self.architecture].runner

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V (MLA: the latent and the rope key) per token over all layers, per byte of
        element size."""
        if self.mla is not None:
            return self.num_layers * self.mla.latent_dim
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _rope(cfg: dict[str, Any], params: dict[str, Any] | None = None, theta: float = 10000.0) -> RopeConfig:
    """The rope of cfg, or of one of its per-layer-type parameter sets (`params`)."""
    if params is None:
        params = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", theta)))
    rope_type = str(params.get("rope_type", params.get("type", "default")))
    rope_type = "longrope" if rope_type == "su" else rope_type  # Phi-3's first name for it
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    original = int(params.get("original_max_position_embeddings")
                   or cfg.get("original_max_position_embeddings") or 8192)
    factor = float(params.get("factor") or 1.0)
    attention_factor = None if params.get("attention_factor") is None else float(params["attention_factor"])
    if rope_type == "longrope":  # transformers' rule: factor and attention factor from the lengths
        factor = float(params.get("factor") or cfg.get("max_position_embeddings", original) / original)
        attention_factor = float(params.get("attention_factor")
                                 or (1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))))
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=factor,
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=original,
        partial_rotary_factor=float(cfg.get("partial_rotary_factor") or params.get("partial_rotary_factor") or 1.0),
        short_factor=tuple(float(x) for x in params.get("short_factor") or ()),
        long_factor=tuple(float(x) for x in params.get("long_factor") or ()),
        beta_fast=float(params.get("beta_fast") or 32.0), beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=float(params.get("mscale") or 0.0), mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
        attention_factor=attention_factor,
        truncate=bool(params.get("truncate", True)),
    )


def _ropes(cfg: dict[str, Any], defaults: dict[str, Any]) -> tuple[RopeConfig, RopeConfig | None]:
    """The global rope and, for families whose sliding layers have their own (Gemma 3), theirs:
    transformers 5 writes one parameter set per layer type; transformers 4 a global rope_theta and
    rope_scaling, and the local base frequency apart."""
    theta = float(defaults.get("rope_theta", 10000.0))
    per_type = cfg.get("rope_parameters") or {}
    if "full_attention" in per_type:
        local = per_type.get("sliding_attention")
        return _rope(cfg, per_type["full_attention"], theta), (_rope(cfg, local) if local else None)
    if "rope_local_base_freq" in defaults:  # Gemma 3, transformers 4
        local_theta = cfg.get("rope_local_base_freq") or defaults["rope_local_base_freq"]
        return _rope(cfg, None, theta), RopeConfig(theta=float(local_theta))
    return _rope(cfg, None, theta), None


def _layer_types(cfg: dict[str, Any], defaults: dict[str, Any]) -> tuple[str, ...]:
    """Gemma's per-layer attention kinds: written out (transformers 5), or every n-th layer global."""
    if "sliding_window_pattern" not in defaults:
        return ()
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if not types:
        every = int(cfg.get("sliding_window_pattern") or defaults["sliding_window_pattern"])
        types = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n)]
    unknown = set(types) - {"sliding_attention", "full_attention"}
    if len(types) != n or unknown:
        raise ValueError(f"layer_types must name one of sliding_attention, full_attention for each of the "
                         f"{n} layers, got {list(types)}")
    return tuple(str(t) for t in types)


def _optional_float(cfg: dict[str, Any], defaults: dict[str, Any], key: str) -> float | None:
    value = cfg.get(key, defaults.get(key))
    return None if value is None else float(value)


def _matryoshka(cfg: dict[str, Any], hidden: int) -> tuple[int, ...] | None:
    """The sizes `dimensions` may truncate embeddings to: config.json's `matryoshka_dimensions`, or any
    size up to the hidden size where it says `is_matryoshka` (vLLM reads the same two fields)."""
    dims = cfg.get("matryoshka_dimensions")
    if dims:
        return tuple(int(d) for d in dims)
    if cfg.get("is_matryoshka"):
        return tuple(range(1, hidden + 1))
    return None


def _sliding_window(cfg: dict[str, Any], arch: str) -> int | None:
    window = cfg.get("sliding_window")
    if arch.startswith("Qwen") and not cfg.get("use_sliding_window", False):
        return None
    if arch.startswith("Qwen") and cfg.get("max_window_layers", 0) < cfg.get("num_hidden_layers", 0):
        raise ValueError("Qwen sliding window on only some layers (max_window_layers) is not supported")
    return int(window) if window else None


def parse_arch_config(cfg: dict[str, Any], generation_cfg: dict[str, Any] | None = None) -> ArchConfig:
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in ARCHITECTURES:
        raise _unsupported(arch)
    defaults = ARCHITECTURES[arch].defaults
    if cfg.get("use_bidirectional_attention"):
        raise ValueError(f"{arch} with use_bidirectional_attention (an encoder) is not supported")
    try:
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        mla = parse_mla(cfg, arch)
        eos = _as_ids((generation_cfg or {}).get("eos_token_id")) or _as_ids(cfg.get("eos_token_id"))
        rope, local_rope = _ropes(cfg, defaults)
        return ArchConfig(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=heads if mla else int(cfg.get("num_key_value_heads") or heads),
            head_dim=mla.qk_head_dim if mla else int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", cfg.get("layer_norm_eps", 1e-6))),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rope=rope,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", cfg.get("qkv_bias", defaults["attention_bias"]))),
            qk_norm=bool(defaults.get("qk_norm", False)),
            sliding_window=_sliding_window(cfg, arch),
            hidden_act=str(cfg.get("hidden_activation") or defaults.get("hidden_activation")
                           or cfg.get("hidden_act") or defaults.get("hidden_act", "silu")),
            dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
            eos_token_ids=eos,
            bos_token_id=cfg.get("bos_token_id"),
            layer_types=_layer_types(cfg, defaults),
            local_rope=local_rope,
            final_logit_softcapping=_optional_float(cfg, defaults, "final_logit_softcapping"),
            attn_logit_softcapping=_optional_float(cfg, defaults, "attn_logit_softcapping"),
            query_pre_attn_scalar=_optional_float(cfg, defaults, "query_pre_attn_scalar"),
            norms_per_layer=int(defaults.get("norms_per_layer", 2)),
            moe=parse_moe(cfg, arch),
            mla=mla,
            type_vocab_size=int(cfg.get("type_vocab_size") or 0),
            matryoshka_dimensions=_matryoshka(cfg, hidden),
            pad_token_id=cfg.get("pad_token_id"),
        )
    except KeyError as e:
        raise ValueError(f"config.json is missing the field {e.args[0]!r}") from None


def load_arch_config(model_dir: str) -> ArchConfig:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isdir(model_dir):
        raise ValueError(f"model path {model_dir!r} is not a directory")
    if not os.path.isfile(path):
        raise ValueError(f"{model_dir!r} has no config.json: not a Hugging Face checkpoint directory")
    cfg = _read_json(path)
    gen_path = os.path.join(model_dir, "generation_config.json")
    gen = _read_json(gen_path) if os.path.isfile(gen_path) else None
    return parse_arch_config(cfg, gen)


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return data
