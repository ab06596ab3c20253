"""The grammar backend's library (xgrammar, or llguidance) in the API process, where it checks requests'
constraints before they reach the engine (structured/grammar.py). It loads at the first request that
carries a constraint, which waits for it, on a worker thread, not on the event loop; the engine core is
asked to load its own grammar backend at the same moment, so the two loads overlap instead of following
each other. xgrammar's import brings torch with it and holds the GIL for long stretches: at start-up it
would compete with the engine core's start and the first requests, and in the background beside serving
it delays every stream's tokens and aborts while it runs, so a server whose requests carry no constraint
never loads it."""

from __future__ import annotations

import asyncio
import importlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

logger = logging.getLogger(__name__)


class GrammarLibrary:
    def __init__(self) -> None:
        self._loading: asyncio.Future[Any] | None = None
        self._engine_side: asyncio.Future[None] | None = None

    async def ready(self, prepare_engine: Callable[[], Awaitable[None]], module: str) -> None:
        """Returns once the library (`module`) is loaded; the first call starts loading it and calls
        `prepare_engine`."""
        if self._loading is None:
            self._loading = asyncio.get_running_loop().run_in_executor(None, importlib.import_module, module)
            self._engine_side = asyncio.ensure_future(prepare_engine())
            self._engine_side.add_done_callback(_log_failure)
        await asyncio.shield(self._loading)  # (a request that gives up does not cancel the import)


def _log_failure(future: asyncio.Future[None]) -> None:
    if not future.cancelled() and future.exception() is not None:
        logger.warning("the engine could not load its grammar backend ahead of time: %s", future.exception())
