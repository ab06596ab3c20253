"""An option that takes a JSON object (vLLM's --speculative-config, --kv-transfer-config, ...): a dict from
Python, its JSON text from the CLI (torch-free)."""

from __future__ import annotations

import json
from typing import Any


def json_object(value: dict[str, Any] | str, name: str) -> dict[str, Any]:
    """The option's object; a ValueError naming the option where the text is not a JSON object."""
    if isinstance(value, dict):
        return value
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as e:
        raise ValueError(f"{name} is not valid JSON ({e.msg}): {value!r}") from None
    if not isinstance(parsed, dict):
        raise ValueError(f"{name} must be a JSON object, got {value!r}")
    return parsed
