"""The directory where tokenmill keeps what it learns about this machine and the checkpoints it has
opened (the roofline's measured ceilings, tokenizer classes): $TOKENMILL_CACHE_DIR, else
$XDG_CACHE_HOME/tokenmill, else ~/.cache/tokenmill."""

from __future__ import annotations

import os


def cache_dir() -> str:
    return os.environ.get("TOKENMILL_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "tokenmill")
