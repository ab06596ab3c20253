"""The directory where tokenmill keeps what it learns about this machine and the checkpoints it has
opened (the roofline's measured ceilings, tokenizer classes): $TOKENMILL_CACHE_DIR, else
$XDG_CACHE_HOME/tokenmill, else ~/.cache/tokenmill. Each cache is one JSON object in a file of its own."""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any


def cache_dir() -> str:
    return os.environ.get("TOKENMILL_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "tokenmill")


def cache_file(name: str) -> str:
    return os.path.join(cache_dir(), name)


def read_json(name: str) -> dict[str, Any]:
    """The object in cache file `name`; empty where the file is missing, unreadable or not an object."""
    try:
        with open(cache_file(name), encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_json(name: str, data: dict[str, Any], indent: int | None = None) -> None:
    """Replace cache file `name` with `data`, atomically (a reader sees the old file or the new one); raises
    OSError where the directory cannot be written."""
    path = cache_file(name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=f".{name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=indent)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
