"""xgrammar in the API process, where it checks requests' constraints before they reach the engine
(structured/grammar.py). It loads at the first request that carries a constraint, which waits for it, on a
worker thread, not on the event loop. Its import takes about 2 s here (torch comes with it) and holds the
GIL for long stretches: at start-up it would compete with the engine core's start and the first requests,
and in the background beside serving it delays every stream's tokens and aborts while it runs, so a
server whose requests carry no constraint never loads it."""

from __future__ import annotations

import asyncio
import importlib
from typing import Any

MODULE = "xgrammar"


class GrammarLibrary:
    def __init__(self) -> None:
        self._loading: asyncio.Future[Any] | None = None

    def load(self) -> asyncio.Future[Any]:
        """Starts loading it (once); the future is done when it is loaded."""
        if self._loading is None:
            self._loading = asyncio.get_running_loop().run_in_executor(None, importlib.import_module, MODULE)
        return self._loading

    async def ready(self) -> None:
        await asyncio.shield(self.load())  # (a request that gives up does not cancel the import)
