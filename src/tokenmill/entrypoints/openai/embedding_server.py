"""`tokenmill serve` for an embedding model (runner 'pooling'): one process, no engine core. The
embedding engine's model runs on one worker thread of the API process (engine/pooling_engine.py),
fed by the dynamic batcher; FastAPI serves /v1/embeddings, /v1/models, /health and /version, and
answers the generate routes with a 400 that says how to start a generating server. SIGTERM or
Ctrl-C stop taking connections, let the requests in flight finish (up to --shutdown-timeout) and exit 0."""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from types import FrameType

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tokenmill import __version__
from tokenmill.config import EngineConfig
from tokenmill.engine.pooling_engine import EmbeddingBatcher, EmbeddingEngine
from tokenmill.entrypoints.openai import serving_batch
from tokenmill.entrypoints.openai.batch_config import BatchConfig, config_from_args
from tokenmill.entrypoints.openai.batch_runner import BatchRunner
from tokenmill.entrypoints.openai.errors import APIError, install_error_handlers
from tokenmill.entrypoints.openai.middleware import GuardMiddleware
from tokenmill.entrypoints.openai.openapi import errors
from tokenmill.entrypoints.openai.protocol import ModelCard, ModelList, VersionResponse
from tokenmill.entrypoints.openai.serving_embedding import EmbeddingRequest, EmbeddingResponse, OpenAIServingEmbedding

GENERATE_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
DEFAULT_BATCH_WAIT_MS = 2.0


def generate_refused(model: str) -> APIError:
    return APIError("invalid_request", f"this server runs the embedding model {model!r} (runner 'pooling') and serves "
                    "/v1/embeddings only; to generate text, start `tokenmill serve MODEL` with a decoder model "
                    "(--runner generate)")


def build_embedding_app(serving: OpenAIServingEmbedding, model_root: str, api_key: str | list[str] | None = None,
                        max_request_bytes: int = 16 * 2**20, batches: BatchRunner | None = None,
                        batch_config: BatchConfig | None = None) -> FastAPI:
    app = FastAPI(title="tokenmill (embeddings)", version=__version__)
    install_error_handlers(app)
    app.add_middleware(GuardMiddleware, api_key=api_key, max_body_bytes=max_request_bytes,
                       path_body_bytes=serving_batch.upload_limits(batch_config, max_request_bytes))
    if batches is not None:
        serving_batch.install(app, batches, batch_config, api_key)
    card = ModelCard(id=serving.model_name, root=model_root, max_model_len=serving.engine.max_model_len)

    async def health() -> Response:
        return Response(status_code=200)

    app.get("/health", response_class=Response)(health)
    app.api_route("/ping", methods=["GET", "POST"], response_class=Response)(health)

    @app.get("/version", response_model=VersionResponse)
    async def version() -> VersionResponse:
        return VersionResponse(version=__version__)

    @app.get("/v1/models", response_model=ModelList, responses=errors(401))
    async def models() -> JSONResponse:
        return JSONResponse(ModelList(data=[card]).model_dump())

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=errors(401, 404))
    async def model(model_id: str) -> JSONResponse:
        serving.check_model(model_id)
        return JSONResponse(card.model_dump())

    @app.post("/v1/embeddings", response_model=EmbeddingResponse, responses=errors(400, 401, 404, 413))
    async def create_embedding(req: EmbeddingRequest) -> JSONResponse:
        return JSONResponse((await serving.create(req)).model_dump())

    async def refuse(raw: Request) -> Response:
        return generate_refused(serving.model_name).response()

    for path in GENERATE_ROUTES:
        app.post(path, responses=errors(400))(refuse)
    return app


class _ReadyServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, ready_line: str, launched: float) -> None:
        super().__init__(config)
        self.ready_line, self.launched = ready_line, launched

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            print(f"{self.ready_line}, ready in {time.time() - self.launched:.1f}s", flush=True)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # uvicorn's own handler re-raises the signal once it has shut down (exit 143); a drained stop is 0.
        # A second signal ends the requests still in flight at once.
        self.force_exit = self.should_exit
        self.should_exit = True


async def run_embedding_server(args: argparse.Namespace, config: EngineConfig, launched: float | None = None) -> int:
    from tokenmill.entrypoints.openai.api_server import bind_socket, model_names

    launched = time.time() if launched is None else launched
    if args.embed_batch_wait_ms < 0:
        raise ValueError(f"--embed-batch-wait-ms must be >= 0, got {args.embed_batch_wait_ms}")
    sock = bind_socket(args.host, args.port)
    try:
        engine = EmbeddingEngine(config)
        batcher = EmbeddingBatcher(engine, args.embed_batch_wait_ms / 1000)
        name, aliases = model_names(config.model.served_model_name, config.model.model)
        serving = OpenAIServingEmbedding(engine, batcher, name, aliases, int(args.max_prompts_per_request))
        batch_config = config_from_args(args)
        runner = serving_batch.open_runner(batch_config)
        app = build_embedding_app(serving, args.model_root or config.model.model, args.api_key,
                                  args.max_request_bytes, runner, batch_config)
        uv = uvicorn.Config(app, log_level=args.uvicorn_log_level, access_log=args.access_log, lifespan="off",
                            timeout_graceful_shutdown=int(args.shutdown_timeout), timeout_keep_alive=30)
        port = sock.getsockname()[1]
        pooler = config.model.pooler
        pooling = f"{pooler.pooling_type} pooling{', normalized' if pooler.normalize else ''}" if pooler else ""
        line = f"tokenmill serving {name} on http://{args.host}:{port} (pid {os.getpid()}, embeddings: {pooling})"
        server = _ReadyServer(uv, line, launched)
        await runner.start()
        await server.serve(sockets=[sock])
        await runner.stop()
        await batcher.shutdown()
        if not server.started:
            print(f"tokenmill: error: could not serve on {args.host}:{port} (see above)", file=sys.stderr)
            return 1
        return 0
    finally:
        sock.close()
