"""The tokenizer class AutoTokenizer chose for a checkpoint, remembered so that a later start loads
that class directly.

`from transformers import AutoTokenizer` imports torch and much of transformers (about 2.3 s here),
and AutoTokenizer.from_pretrained reads the model config with it; the class it settles on imports in a
fraction of that. An entry is written only after a direct load of the chosen class is checked equal
to AutoTokenizer's result (same class, backend pipeline, vocabulary, special tokens, chat template and
ids of a probe text), and it is keyed by the checkpoint's real path, the size and modification time of
each of its non-weight files, and the transformers version, so an edited checkpoint or another
transformers resolves afresh. Entries live in tokenizer_classes.json in the user cache directory; an
unreadable or unwritable cache only means AutoTokenizer runs."""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import stat
from typing import Any

from tokenmill.user_cache import read_json, write_json

CACHE_FILE = "tokenizer_classes.json"
MAX_ENTRIES = 64
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5", ".onnx")
_PROBE = "Hello world! 1234  tabs\tand\nnewlines — ünïcödé, <s> and </s>."


def _transformers_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("transformers")
    except Exception:  # no distribution metadata
        return None


def checkpoint_key(path: str) -> str | None:
    """What an entry for path is valid for; None where the directory cannot be listed."""
    version = _transformers_version()
    if version is None:
        return None
    real = os.path.realpath(path)
    try:
        names = sorted(os.listdir(real))
        files = []
        for name in names:
            if name.endswith(_WEIGHT_SUFFIXES):
                continue
            st = os.stat(os.path.join(real, name))
            if stat.S_ISREG(st.st_mode):
                files.append(f"{name}:{st.st_size}:{st.st_mtime_ns}")
    except OSError:
        return None
    return json.dumps([real, version, files])


def cached_class(path: str) -> type | None:
    """The class remembered for this checkpoint as it is now, imported; None if there is none."""
    key = checkpoint_key(path)
    entry = read_json(CACHE_FILE).get(key) if key is not None else None
    if not isinstance(entry, dict):
        return None
    module, name = entry.get("module"), entry.get("name")
    if not (isinstance(module, str) and isinstance(name, str) and module.startswith("transformers.")):
        return None
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None
    return cls if isinstance(cls, type) else None


def remember(path: str, tokenizer: Any) -> bool:
    """Record type(tokenizer) for this checkpoint if a direct load of that class gives the same
    tokenizer; returns whether it was recorded."""
    cls = type(tokenizer)
    key = checkpoint_key(path)
    if key is None or not cls.__module__.startswith("transformers."):
        return False
    try:
        direct = cls.from_pretrained(path, local_files_only=True)
        same = same_tokenizer(tokenizer, direct)
    except Exception:  # transformers raises many types; the class is then not remembered
        return False
    if not same:
        return False
    data = read_json(CACHE_FILE)
    data.pop(key, None)
    data[key] = {"module": cls.__module__, "name": cls.__name__}
    while len(data) > MAX_ENTRIES:  # the oldest entries (dicts keep insertion order) go first
        data.pop(next(iter(data)))
    with contextlib.suppress(OSError):
        write_json(CACHE_FILE, data)
    return True


def same_tokenizer(a: Any, b: Any) -> bool:
    """Whether two loaded tokenizers behave the same: class, backend pipeline (tokenizers' JSON) or
    vocabulary, special tokens, chat template, and the ids and text of a probe with and without
    special tokens."""
    if type(a) is not type(b):
        return False
    pipelines = [t.backend_tokenizer.to_str() if hasattr(t, "backend_tokenizer") else None for t in (a, b)]
    if pipelines[0] != pipelines[1]:
        return False
    if a.get_vocab() != b.get_vocab() or a.all_special_tokens != b.all_special_tokens:
        return False
    if getattr(a, "chat_template", None) != getattr(b, "chat_template", None):
        return False
    for special in (True, False):
        ids_a = a.encode(_PROBE, add_special_tokens=special)
        if ids_a != b.encode(_PROBE, add_special_tokens=special) or a.decode(ids_a) != b.decode(ids_a):
            return False
    return True
