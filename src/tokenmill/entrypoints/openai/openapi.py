"""/openapi.json as the server behaves: each route's documented errors are the ones it sends, in
the OpenAI error schema (FastAPI's default 422 is never sent: validation errors are 400s), and
the bearer scheme on every route but the open ones when an API key is set."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from tokenmill.entrypoints.openai.errors import ERROR_CODES
from tokenmill.entrypoints.openai.middleware import OPEN_PATHS
from tokenmill.entrypoints.openai.protocol import ErrorResponse
from tokenmill.entrypoints.openai.request_types import TOKEN_COUNT_MARK, TOKEN_ID_MARK

_DESCRIPTIONS = {400: "invalid request", 401: "missing or wrong API key", 404: "unknown model, file or batch",
                 409: "the batch cannot be cancelled in its status",
                 408: "request timeout", 413: "request body too large", 429: "the server's queue is full",
                 503: "the engine is not available"}
# the other way a generating route answers 200 (with "stream": true): server-sent events, each a chunk
# (or an error) as JSON in `data`, the last one `data: [DONE]`
_EVENT = {"type": "object", "required": ["data"],
          "properties": {"data": {"type": "string", "description": "a JSON chunk, an error, or [DONE]"},
                         "event": {"type": "string"}}}
SSE: dict[int | str, dict[str, Any]] = {200: {"content": {"text/event-stream": {"schema": _EVENT}}}}


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    codes = {s: ", ".join(c for c, st in ERROR_CODES.items() if st == s) for s in statuses}
    return {s: {"model": ErrorResponse, "description": f"{_DESCRIPTIONS[s]} (code: {codes[s]})"} for s in statuses}


def install_openapi(app: FastAPI, secured: bool, model_name: str, vocab_size: int, max_model_len: int) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            _set_model_bounds(schema, {TOKEN_ID_MARK: vocab_size - 1, TOKEN_COUNT_MARK: max_model_len - 1})
            for path, operations in schema.get("paths", {}).items():
                for method, op in operations.items():
                    op.get("responses", {}).pop("422", None)
                    if len(operations) > 1:  # one function on several methods (/ping): FastAPI names them alike
                        op["operationId"] = f"{op['operationId'].rsplit('_', 1)[0]}_{method}"
                    if secured and path in OPEN_PATHS:
                        op["security"] = []
                    for param in op.get("parameters", []):
                        if param["name"] == "model_id":
                            param["schema"]["examples"] = [model_name]
            component_schemas = schema.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                component_schemas.pop(name, None)
            if secured:
                schema.setdefault("components", {})["securitySchemes"] = {
                    "bearer": {"type": "http", "scheme": "bearer"}}
                schema["security"] = [{"bearer": []}]
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _set_model_bounds(node: Any, maxima: dict[str, int]) -> None:
    """Each schema marked as a token id or a token count gets the served model's maximum."""
    if isinstance(node, dict):
        for mark, maximum in maxima.items():
            if node.pop(mark, None):
                node["maximum"] = maximum
        for value in node.values():
            _set_model_bounds(value, maxima)
    elif isinstance(node, list):
        for value in node:
            _set_model_bounds(value, maxima)
