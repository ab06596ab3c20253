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
import os
from dataclasses import dataclass, field
from typing import Any


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


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    partial_rotary_factor: float = 1.0


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
    type_vocab_size: int = 0  # token-type (segment) embeddings of encoder families
    matryoshka_dimensions: tuple[int, ...] | None = None  # embedding sizes it was trained to truncate to
    pad_token_id: int | None = None

    @property
    def default_runner(self) -> str:
        return ARCHITECTURES[self.architecture].runner

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per token over all layers, per byte of element size."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _rope(cfg: dict[str, Any]) -> RopeConfig:
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = str(params.get("rope_type", params.get("type", "default")))
    if rope_type not in ("default", "linear", "llama3"):
        raise ValueError(f"rope type {rope_type!r} is not supported (supported: default, linear, llama3)")
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
        partial_rotary_factor=float(cfg.get("partial_rotary_factor") or params.get("partial_rotary_factor") or 1.0),
    )


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
    try:
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        eos = _as_ids((generation_cfg or {}).get("eos_token_id")) or _as_ids(cfg.get("eos_token_id"))
        return ArchConfig(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", cfg.get("layer_norm_eps", 1e-6))),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rope=_rope(cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", defaults["attention_bias"])),
            qk_norm=bool(defaults.get("qk_norm", False)),
            sliding_window=_sliding_window(cfg, arch),
            hidden_act=str(cfg.get("hidden_act", defaults.get("hidden_act", "silu"))),
            dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
            eos_token_ids=eos,
            bos_token_id=cfg.get("bos_token_id"),
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
