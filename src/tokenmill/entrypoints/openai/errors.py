"""OpenAI-shaped errors: one exception type, and handlers that turn every failure (our own,
pydantic's, Starlette's 404/405, bugs) into `{"error": {message, type, param, code}}`."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill.entrypoints.openai.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

_UNION_FIELDS = {
    "prompt": "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists",
    "stop": "stop must be a string or a list of strings",
}


def _is_type_tag(part: object) -> bool:
    """pydantic names the union member in an error's loc ('str', 'list[int]', 'TextPart')."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part
                                      or part[:1].isupper())


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param,
                                             code=self.code))

    def response(self) -> JSONResponse:
        return JSONResponse(self.body().model_dump(), status_code=self.status)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def from_validation(exc: RequestValidationError) -> APIError:
    errors: list[Any] = list(exc.errors())
    if not errors:
        return bad_request("invalid request")
    err = max(errors, key=lambda e: len(e.get("loc", ())))  # the deepest is the most specific
    loc = [str(x) for x in err.get("loc", ()) if x != "body" and not _is_type_tag(x)]
    field = ".".join(loc) or None
    kind = err.get("type", "")
    if kind == "unsupported_field":
        return bad_request(str(err.get("msg")), param=(err.get("ctx") or {}).get("field"))
    if kind == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {field}", param=field)
    if kind == "json_invalid":
        return bad_request("the request body is not valid JSON: "
                           f"{(err.get('ctx') or {}).get('error', err.get('msg'))}")
    if kind == "missing":
        if not loc:
            return bad_request("the request needs a JSON body")
        return bad_request(f"'{field}' is a required property", param=field)
    if kind == "model_attributes_type" and not loc:
        return bad_request("the request body must be a JSON object")
    if loc and loc[0] in _UNION_FIELDS and len(loc) > 1:
        return bad_request(_UNION_FIELDS[loc[0]], param=loc[0])
    return bad_request(f"{field}: {err.get('msg')}" if field else str(err.get("msg")), param=field)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return from_validation(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            err = APIError(404, f"no route {request.method} {request.url.path}", code="not_found")
        elif exc.status_code == 405:
            err = APIError(405, f"method {request.method} is not allowed on {request.url.path}",
                           code="method_not_allowed")
        else:
            err = APIError(exc.status_code, str(exc.detail))
        return err.response()

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return APIError(500, f"internal server error: {type(exc).__name__}: {exc}", type="server_error",
                        code="internal_error").response()
