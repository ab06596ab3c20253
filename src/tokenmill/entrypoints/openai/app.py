"""The FastAPI app: routes, the API-key and body-size guard, and OpenAI-shaped errors."""

from __future__ import annotations

import secrets
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenmill import __version__
from tokenmill.engine.async_engine import EngineDeadError
from tokenmill.engine.input_processor import check_token_ids
from tokenmill.entrypoints.openai import serving_responses
from tokenmill.entrypoints.openai.errors import APIError, bad_request, install_error_handlers
from tokenmill.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from tokenmill.entrypoints.openai.serving_chat import OpenAIServingChat
from tokenmill.entrypoints.openai.serving_completion import OpenAIServingCompletion
from tokenmill.entrypoints.openai.serving_engine import ServerContext, engine_dead

DEFAULT_MAX_REQUEST_BYTES = 16 * 2**20
_PROTECTED = ("/v1/", "/tokenize", "/detokenize", "/reset_prefix_cache")


class GuardMiddleware:
    """API key on the OpenAI routes (401) and a request-body size limit (413; a chunked body
    that runs over is cut, which the JSON parser then rejects with 400)."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if self.expected is not None and scope["path"].startswith(_PROTECTED):
            if not secrets.compare_digest(headers.get(b"authorization", b""), self.expected):
                missing = b"authorization" not in headers
                message = ("You didn't provide an API key (Authorization: Bearer KEY)." if missing
                           else "Incorrect API key provided.")
                await _send(send, APIError(401, message, code="invalid_api_key"))
                return
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await _send(send, APIError(413, f"the request body is {int(length)} bytes; the limit is "
                                            f"{self.max_body_bytes}", code="request_too_large"))
            return
        await self.app(scope, self._limited(receive) if length is None else receive, send)

    def _limited(self, receive: Receive) -> Receive:
        seen = 0

        async def wrapped() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    return {"type": "http.request", "body": b"", "more_body": False}
            return message

        return wrapped


async def _send(send: Send, error: APIError) -> None:
    body = error.body().model_dump_json().encode()
    await send({"type": "http.response.start", "status": error.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def build_app(ctx: ServerContext, api_key: str | None = None,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> FastAPI:
    app = FastAPI(title="tokenmill", version=__version__)
    install_error_handlers(app)
    app.add_middleware(GuardMiddleware, api_key=api_key, max_body_bytes=max_request_bytes)
    engine = ctx.engine
    completions = OpenAIServingCompletion(ctx)
    chat = OpenAIServingChat(ctx)
    card = ModelCard(id=ctx.model_name, root=engine.config.model.model,
                     max_model_len=engine.config.model.max_model_len)

    @app.get("/health")
    async def health() -> Response:
        error = engine.dead_error
        if error is not None:
            return engine_dead(error).response()
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(ModelList(data=[card]).model_dump())

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> JSONResponse:
        completions.check_model(model_id)
        return JSONResponse(card.model_dump())

    @app.post("/v1/completions")
    async def create_completion(req: CompletionRequest, raw: Request) -> Response:
        return await completions.create(req, raw)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(req: ChatCompletionRequest, raw: Request) -> Response:
        return await chat.create(req, raw)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> JSONResponse:
        completions.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of 'prompt' or 'messages'", "prompt")
        if req.messages is not None:
            ids = chat.template_ids(req.messages, req.add_generation_prompt)
        else:
            add = True if req.add_special_tokens is None else req.add_special_tokens
            ids = [int(t) for t in chat.tokenizer(req.prompt, add_special_tokens=add)["input_ids"]]
        strs = chat.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return JSONResponse(TokenizeResponse(count=len(ids), max_model_len=card.max_model_len or 0, tokens=ids,
                                             token_strs=strs).model_dump(exclude_none=True))

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> JSONResponse:
        completions.check_model(req.model)
        try:
            check_token_ids(req.tokens, engine.config.model.arch.vocab_size, "tokens")
        except ValueError as e:
            raise bad_request(str(e), "tokens") from None
        return JSONResponse(DetokenizeResponse(prompt=str(chat.tokenizer.decode(req.tokens))).model_dump())

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict[str, Any]:
        try:
            return {"reset": await engine.reset_prefix_cache()}
        except EngineDeadError as e:
            raise engine_dead(e) from None

    serving_responses.register(app, ctx)
    return app
