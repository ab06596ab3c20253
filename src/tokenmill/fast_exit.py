"""Ending a process without the interpreter's teardown (the API process of `tokenmill serve`
and the engine core process both end this way)."""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn


def fast_exit(code: int) -> NoReturn:
    """Flushes the logs and the standard streams, then exits at once: the interpreter's teardown
    takes seconds with torch loaded, and a caller has nothing else left to release."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
