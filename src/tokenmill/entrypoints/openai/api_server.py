"""Runs the OpenAI server: engine core process + AsyncLLM + FastAPI under uvicorn, all in one
event loop; Ctrl-C / SIGTERM stop uvicorn gracefully, then the core process.

The web stack (FastAPI, uvicorn: slow imports) is imported only after the core process has
been started, so those imports overlap the core's torch import and model load (cold start)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
import time
from typing import TYPE_CHECKING, Any

from tokenmill.config import EngineArgs
from tokenmill.engine.async_engine import AsyncLLM

if TYPE_CHECKING:
    import uvicorn

logger = logging.getLogger(__name__)


def _make_server(config: uvicorn.Config, ready_line: str, launched: float) -> uvicorn.Server:
    import uvicorn

    class _Server(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            if self.started:
                print(f"{ready_line}, ready in {time.time() - launched:.1f}s", flush=True)

    return _Server(config)


def _raise_exit(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def model_names(served_name: str, model: str) -> tuple[str, frozenset[str]]:
    aliases = {model, os.path.abspath(model), os.path.basename(os.path.normpath(model))}
    return served_name, frozenset(aliases - {served_name})


async def run_server(args: argparse.Namespace, engine_args: EngineArgs, chat_template: str | None,
                     launched: float | None = None) -> int:
    """Serves until SIGINT/SIGTERM; `launched` (a time.time()) is what "ready in" counts from."""
    launched = time.time() if launched is None else launched
    signal.signal(signal.SIGTERM, _raise_exit)  # uvicorn restores and re-raises it after a graceful stop
    starting = asyncio.ensure_future(AsyncLLM.from_engine_args(
        engine_args, args.max_queue_len, logging.getLevelName(logging.getLogger().level)))
    await asyncio.sleep(0)  # the task starts the core process before the web stack is imported
    import uvicorn

    from tokenmill.entrypoints.openai.app import build_app
    from tokenmill.entrypoints.openai.serving_engine import ServerContext

    engine = await starting
    try:
        model = engine.config.model
        name, aliases = model_names(model.served_model_name, model.model)
        ctx = ServerContext(engine, name, aliases, chat_template, args.request_timeout)
        app = build_app(ctx, args.api_key, args.max_request_bytes)
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                                access_log=args.access_log, lifespan="off", timeout_graceful_shutdown=5,
                                timeout_keep_alive=30)
        line = (f"tokenmill serving {name} on http://{args.host}:{args.port} "
                f"(engine core pid {engine.client.pid}, {engine.num_blocks} KV blocks)")
        server = _make_server(config, line, launched)
        await server.serve()
        if not server.started:
            print(f"tokenmill: error: could not serve on {args.host}:{args.port} (see above)", file=sys.stderr)
            return 1
        return 0
    finally:
        await engine.shutdown()
