"""The FastAPI app: routes, each documented with the status codes it sends and its response
model, behind GuardMiddleware (API key, body size, request ids, bugs as 500s)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from tokenmill import __version__
from tokenmill.engine.async_engine import EngineDeadError
from tokenmill.engine.input_processor import check_token_ids
from tokenmill.entrypoints.openai import dashboard, serving_batch, serving_responses
from tokenmill.entrypoints.openai.batch_config import BatchConfig
from tokenmill.entrypoints.openai.batch_runner import BatchRunner
from tokenmill.entrypoints.openai.errors import APIError, bad_request, install_error_handlers
from tokenmill.entrypoints.openai.middleware import GuardMiddleware, api_keys
from tokenmill.entrypoints.openai.openapi import SSE, errors, install_openapi
from tokenmill.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    ResetPrefixCacheResponse,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
)
from tokenmill.entrypoints.openai.serving_chat import OpenAIServingChat
from tokenmill.entrypoints.openai.serving_completion import OpenAIServingCompletion
from tokenmill.entrypoints.openai.serving_engine import ServerContext, engine_dead

DEFAULT_MAX_REQUEST_BYTES = 16 * 2**20
_GENERATE = errors(400, 401, 404, 408, 413, 429, 503) | SSE
_HEALTH: dict[int | str, dict[str, Any]] = {200: {"description": "the engine is serving", "content": None},
                                            **errors(503)}


def build_app(ctx: ServerContext, api_key: str | list[str] | None = None,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, batches: BatchRunner | None = None,
              batch_config: BatchConfig | None = None, stopping: Callable[[], bool] = lambda: False) -> FastAPI:
    """The app; with `batches` (a runner whose store is under `batch_config`'s directory) also the
    Files and Batch API, whose lines the runner sends through this app. `stopping` ends the dashboard's
    event streams (the server is draining)."""
    app = FastAPI(title="tokenmill", version=__version__)
    install_error_handlers(app)
    engine = ctx.engine
    install_openapi(app, bool(api_keys(api_key)), ctx.model_name, engine.config.model.arch.vocab_size,
                    engine.config.model.max_model_len)
    app.add_middleware(GuardMiddleware, api_key=api_key, max_body_bytes=max_request_bytes,
                       path_body_bytes=serving_batch.upload_limits(batch_config, max_request_bytes))
    completions = OpenAIServingCompletion(ctx)
    chat = OpenAIServingChat(ctx)
    card = ModelCard(id=ctx.model_name, root=ctx.model_root, max_model_len=engine.config.model.max_model_len)

    async def health() -> Response:
        error = engine.health_error
        if error is not None:
            return engine_dead(error).response()
        return Response(status_code=200)

    app.get("/health", response_class=Response, responses=_HEALTH)(health)
    app.api_route("/ping", methods=["GET", "POST"], response_class=Response, responses=_HEALTH,
                  description="the same as /health")(health)

    @app.get("/version", response_model=VersionResponse)
    async def version() -> VersionResponse:
        return VersionResponse(version=__version__)

    @app.get("/metrics", response_class=PlainTextResponse, description="Prometheus metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", response_model=ModelList, responses=errors(401))
    async def models() -> JSONResponse:
        return JSONResponse(ModelList(data=[card]).model_dump())

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=errors(401, 404))
    async def model(model_id: str) -> JSONResponse:
        completions.check_model(model_id)
        return JSONResponse(card.model_dump())

    @app.post("/v1/completions", response_model=CompletionResponse, responses=_GENERATE)
    async def create_completion(req: CompletionRequest, raw: Request) -> Response:
        return await completions.create(req, raw)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=_GENERATE)
    async def create_chat_completion(req: ChatCompletionRequest, raw: Request) -> Response:
        return await chat.create(req, raw)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=errors(400, 401, 404, 413))
    async def tokenize(req: TokenizeRequest) -> JSONResponse:
        completions.check_model(req.model)
        if req.messages is not None:
            ids = chat.template_ids(req.messages, req.add_generation_prompt)
        else:
            add = True if req.add_special_tokens is None else req.add_special_tokens
            ids = chat.tokenize_text(req.prompt or "", add)
        strs = chat.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return JSONResponse(TokenizeResponse(count=len(ids), max_model_len=card.max_model_len or 0, tokens=ids,
                                             token_strs=strs).model_dump(exclude_none=True))

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=errors(400, 401, 404, 413))
    async def detokenize(req: DetokenizeRequest) -> JSONResponse:
        completions.check_model(req.model)
        try:
            check_token_ids(req.tokens, engine.config.model.arch.vocab_size, "tokens")
        except ValueError as e:
            raise bad_request(str(e), "tokens") from None
        return JSONResponse(DetokenizeResponse(prompt=str(chat.tokenizer.decode(req.tokens))).model_dump())

    @app.post("/reset_prefix_cache", response_model=ResetPrefixCacheResponse, responses=errors(401, 413, 503))
    async def reset_prefix_cache() -> ResetPrefixCacheResponse:
        try:
            return ResetPrefixCacheResponse(reset=await engine.reset_prefix_cache())
        except EngineDeadError as e:
            raise engine_dead(e) from None

    @app.post("/v1/embeddings", include_in_schema=False)  # a refusal, not an operation of this server
    async def embeddings_refused() -> Response:
        return APIError("invalid_request", f"this server generates text with {ctx.model_name!r} and serves no "
                        "embeddings; start an embedding server with `tokenmill serve MODEL --runner pooling` (an "
                        "embedding checkpoint such as a sentence-transformers BertModel pools by default; a decoder "
                        "takes --pooler-config)", "model").response()

    serving_responses.register(app, ctx)
    dashboard.register(app, engine.metrics.live, lambda: stopping() or engine.dead_error is not None)
    if batches is not None:
        serving_batch.install(app, batches, batch_config, api_key)
    return app
