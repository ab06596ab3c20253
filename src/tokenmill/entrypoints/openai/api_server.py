"""Runs the OpenAI server: engine core process + AsyncLLM + FastAPI under uvicorn, all in one
event loop. Ctrl-C / SIGTERM drain the requests in flight, and a dead engine core ends them, both
through lifecycle.ServerLifecycle; then uvicorn closes, then the core process stops.

The listening socket is bound first, so a bad or busy address fails before anything loads. The web
stack (FastAPI, uvicorn: slow imports) is imported only after the core process has been started,
so those imports overlap the core's torch import and model load (cold start)."""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Any

from tokenmill.config import EngineArgs
from tokenmill.engine.async_engine import AsyncLLM
from tokenmill.engine.core_client import CoreClient, EngineCoreClient

if TYPE_CHECKING:
    import uvicorn

    from tokenmill.entrypoints.openai.lifecycle import ServerLifecycle

logger = logging.getLogger(__name__)


def _make_server(config: uvicorn.Config, ready_line: str, launched: float,
                 lifecycle: ServerLifecycle) -> uvicorn.Server:
    import uvicorn

    class _Server(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            if self.started:
                print(f"{ready_line}, ready in {time.time() - launched:.1f}s", flush=True)

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            lifecycle.signal_received()  # the lifecycle drains, then sets should_exit; nothing to re-raise

    return _Server(config)


def bind_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound (not yet listening: connections are refused until the server is ready)."""
    if not 0 <= port <= 65535:
        raise ValueError(f"--port must be between 0 and 65535, got {port}")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise ValueError(f"--host {host!r} is not an address to serve on: {e.strerror}") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        sock.close()
        reason = "the port is in use" if e.errno == errno.EADDRINUSE else e.strerror
        raise ValueError(f"cannot serve on {host}:{port}: {reason}") from None
    return sock


def _raise_exit(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def max_sequences_per_request(args: argparse.Namespace, max_num_seqs: int) -> int:
    """--max-prompts-per-request, or the server's whole capacity when --max-queue-len sets one and
    that is less: a request over it could never be admitted."""
    if args.max_queue_len is None:
        return int(args.max_prompts_per_request)
    return min(int(args.max_prompts_per_request), max_num_seqs + args.max_queue_len)


def model_names(served_name: str, model: str) -> tuple[str, frozenset[str]]:
    aliases = {model, os.path.abspath(model), os.path.basename(os.path.normpath(model))}
    return served_name, frozenset(aliases - {served_name})


def _register_with_router(args: argparse.Namespace, port: int) -> asyncio.Task[None] | None:
    """--register-with ROUTER_URL: heartbeat this server's URL (--advertise-url, or host:port) to a router."""
    router_url = getattr(args, "register_with", None)
    if not router_url:
        return None
    from tokenmill.entrypoints.openai.router_registration import register_forever

    own = getattr(args, "advertise_url", None) or f"http://{args.host}:{port}"
    return asyncio.create_task(register_forever(router_url, own, getattr(args, "router_api_key", None)))


async def run_server(args: argparse.Namespace, engine_args: EngineArgs, chat_template: str | None,
                     launched: float | None = None,
                     client_factory: Callable[[EngineArgs, str], EngineCoreClient] = CoreClient) -> int:
    """Serves until SIGINT/SIGTERM or the engine core's death; returns the exit status (lifecycle's
    EXIT_*). `launched` (a time.time()) is what "ready in" counts from; `client_factory` starts the
    engine core (--data-parallel-size: its replicas)."""
    launched = time.time() if launched is None else launched
    sock = bind_socket(args.host, args.port)
    try:
        signal.signal(signal.SIGTERM, _raise_exit)  # while loading; the server handles it once up
        starting = asyncio.ensure_future(AsyncLLM.from_engine_args(
            engine_args, args.max_queue_len, logging.getLevelName(logging.getLogger().level), client_factory))
        await asyncio.sleep(0)  # the task starts the core process before the web stack is imported
        import uvicorn

        from tokenmill.entrypoints.openai import observability, serving_batch
        from tokenmill.entrypoints.openai.app import build_app
        from tokenmill.entrypoints.openai.batch_config import config_from_args
        from tokenmill.entrypoints.openai.lifecycle import CLOSE_GRACE, EXIT_ENGINE_DEAD, ServerLifecycle
        from tokenmill.entrypoints.openai.serving_engine import ServerContext

        engine = await starting
    except BaseException:
        sock.close()
        raise
    try:
        model = engine.config.model
        name, aliases = model_names(model.served_model_name, model.model)
        ctx = ServerContext(engine, name, aliases, chat_template, args.request_timeout, args.model_root or model.model,
                            max_sequences_per_request(args, engine.config.scheduler.max_num_seqs),
                            tool_call_parser=getattr(args, "tool_call_parser", None),
                            enable_auto_tool_choice=getattr(args, "enable_auto_tool_choice", False))
        observability.apply(engine, args)
        pids = getattr(engine.client, "pids", None)  # data parallelism: a core process per replica
        if pids is not None:
            engine.metrics.registry.register(engine.client.collector())  # type: ignore[attr-defined]
        lifecycle = ServerLifecycle(engine, args.shutdown_timeout)
        batch_config = config_from_args(args)
        batches = serving_batch.open_runner(batch_config)
        app = lifecycle.wrap(build_app(ctx, args.api_key, args.max_request_bytes, batches, batch_config,
                                       lambda: lifecycle.refusal is not None))
        config = uvicorn.Config(app, log_level=args.uvicorn_log_level, access_log=args.access_log, lifespan="off",
                                timeout_graceful_shutdown=int(CLOSE_GRACE), timeout_keep_alive=30)
        port = sock.getsockname()[1]
        line = (f"tokenmill serving {name} on http://{args.host}:{port} "
                f"(engine core pid {engine.client.pid}, {engine.num_blocks} KV blocks"
                + (f"; {len(pids)} data-parallel replicas, engine core pids {', '.join(map(str, pids))})"
                   if pids is not None else ")"))
        server = _make_server(config, line, launched, lifecycle)
        lifecycle.start(lambda: setattr(server, "should_exit", True))
        await batches.start()  # resumes the batches a stop or a crash left unfinished
        beat = _register_with_router(args, port)
        try:
            await server.serve(sockets=[sock])
        finally:
            if beat is not None:
                beat.cancel()
            await batches.stop()
        if not server.started:
            print(f"tokenmill: error: could not serve on {args.host}:{port} (see above)", file=sys.stderr)
            return EXIT_ENGINE_DEAD
        if lifecycle.exit_code == EXIT_ENGINE_DEAD:
            print(f"tokenmill: error: {engine.dead_error}; the server exits (status {EXIT_ENGINE_DEAD}) for a "
                  "supervisor to restart it", file=sys.stderr, flush=True)
        return lifecycle.exit_code
    finally:
        sock.close()
        await engine.shutdown()
        if engine.metrics.tracer is not None:
            engine.metrics.tracer.shutdown()  # exports the spans still batched
