"""xgrammar in the API process, where it checks requests' constraints before they reach the engine
(structured/grammar.py). Its import takes about 2 s here (torch comes with it), so it never runs on the
event loop and never at start-up, where it would compete with the engine core's start and the first
requests: it loads on a worker thread once the server has answered its first request, or at the first
request that carries a constraint, which waits for it."""

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
