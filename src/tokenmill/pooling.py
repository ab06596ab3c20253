"""The torch-free description of how an embedding model turns hidden states into one vector per
input: `PoolerConfig` (pooling type, normalisation), read from a sentence-transformers checkpoint's
own files or given by the user (`--pooler-config`, vLLM's flag), and the checkpoint's
`max_seq_length`.

A sentence-transformers checkpoint lists its modules in `modules.json` (Transformer, Pooling,
Normalize, ...); the Pooling module's `config.json` names the pooling mode and a Normalize module
means unit-length outputs. sentence-transformers itself is not needed to read them.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from tokenmill.json_arg import json_object

POOLING_TYPES = ("MEAN", "CLS", "LAST")
# sentence-transformers' Pooling config flags -> our pooling type
_ST_MODES = {"pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS",
             "pooling_mode_lasttoken": "LAST"}
_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"


@dataclass(frozen=True)
class PoolerConfig:
    pooling_type: str = "LAST"  # MEAN | CLS | LAST
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type {self.pooling_type!r} is not supported; choose from "
                             f"{', '.join(POOLING_TYPES)}")


def parse_pooler_config(value: str | dict[str, Any]) -> dict[str, Any]:
    """--pooler-config's JSON object (vLLM's field names: pooling_type, normalize), checked."""
    raw = json_object(value, "pooler_config")
    unknown = set(raw) - {"pooling_type", "normalize"}
    if unknown:
        raise ValueError(f"pooler_config: unknown field(s) {', '.join(sorted(unknown))} "
                         "(known: pooling_type, normalize)")
    if "pooling_type" in raw and not isinstance(raw["pooling_type"], str):
        raise ValueError("pooler_config: pooling_type must be a string")
    if "normalize" in raw and not isinstance(raw["normalize"], bool):
        raise ValueError("pooler_config: normalize must be true or false")
    out = dict(raw)
    if "pooling_type" in out:
        out["pooling_type"] = out["pooling_type"].upper()
    return out


def checkpoint_pooler(model_dir: str) -> PoolerConfig | None:
    """The pooling a sentence-transformers checkpoint declares, or None where it has no modules.json."""
    modules = _read_json(os.path.join(model_dir, "modules.json"))
    if not isinstance(modules, list):
        return None
    types = {m.get("type"): m for m in modules if isinstance(m, dict)}
    normalize = _ST_NORMALIZE in types
    pooling = types.get(_ST_POOLING)
    if pooling is None:
        return PoolerConfig("MEAN", normalize)
    cfg = _read_json(os.path.join(model_dir, str(pooling.get("path", "")), "config.json"))
    if not isinstance(cfg, dict):
        raise ValueError(f"{model_dir!r}: the Pooling module's config.json is missing or not a JSON object")
    modes = [kind for flag, kind in _ST_MODES.items() if cfg.get(flag)]
    others = [k for k, v in cfg.items() if k.startswith("pooling_mode_") and v and k not in _ST_MODES]
    if others or len(modes) != 1:
        raise ValueError(f"{model_dir!r}: sentence-transformers pooling {sorted(others or modes)} is not supported "
                         f"(one of {', '.join(sorted(_ST_MODES))})")
    return PoolerConfig(modes[0], normalize)


def checkpoint_max_seq_length(model_dir: str) -> int | None:
    """sentence_bert_config.json's max_seq_length: the most tokens sentence-transformers encodes."""
    cfg = _read_json(os.path.join(model_dir, "sentence_bert_config.json"))
    if isinstance(cfg, dict) and isinstance(cfg.get("max_seq_length"), int):
        return int(cfg["max_seq_length"])
    return None


def resolve_pooler_config(model_dir: str, override: str | dict[str, Any] | None) -> PoolerConfig:
    """The checkpoint's pooling (or vLLM's default for a decoder: LAST, normalised), with the user's fields
    over it."""
    base = checkpoint_pooler(model_dir) or PoolerConfig()
    if override is None:
        return base
    fields = parse_pooler_config(override)
    return PoolerConfig(fields.get("pooling_type", base.pooling_type), fields.get("normalize", base.normalize))


def _read_json(path: str) -> Any:
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None
