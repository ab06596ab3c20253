"""OpenAI-shaped errors: one exception type, and handlers that turn every failure (our own,
pydantic's, Starlette's 404/405) into `{"error": {message, type, param, code}}`. Bugs become a
500 in GuardMiddleware, the outermost layer, so the connection stays usable.

Every error carries one stable `code` (OpenAI's own where OpenAI has one):

| status | code                    | when                                                                   |
|--------|-------------------------|------------------------------------------------------------------------|
| 400    | invalid_request         | the body is not a JSON object, a field is missing or has the wrong type |
| 400    | invalid_value           | a field's value is out of range or not allowed                          |
| 400    | unknown_parameter       | a field tokenmill does not know                                         |
| 400    | unsupported_parameter   | an OpenAI feature tokenmill does not implement (tools, audio...)        |
| 400    | context_length_exceeded | the prompt, or prompt plus max_tokens, does not fit max_model_len       |
| 400    | too_many_sequences      | prompts x n over --max-prompts-per-request                              |
| 400    | invalid_file            | an upload that is not JSONL (not UTF-8, or no line is a JSON object)    |
| 400    | file_too_large          | an upload over --max-batch-file-bytes                                   |
| 401    | invalid_api_key         | the API key is missing or wrong                                         |
| 404    | model_not_found         | the model named is not the one served                                   |
| 404    | response_not_found      | no stored response has that id (/v1/responses)                          |
| 404    | file_not_found          | no file with that id belongs to the caller's API key (/v1/files)        |
| 404    | batch_not_found         | no batch with that id belongs to the caller's API key (/v1/batches)     |
| 404    | not_found               | no such route                                                           |
| 405    | method_not_allowed      | the route exists, not with this method (the Allow header lists those)   |
| 408    | timeout                 | the request ran past --request-timeout and was aborted                  |
| 409    | batch_not_cancellable   | cancel of a batch that has ended (completed, failed, expired)           |
| 413    | payload_too_large       | the body is over --max-request-bytes                                    |
| 429    | rate_limit_exceeded     | the server's queue (--max-queue-len) is full; retry later               |
| 499    | client_closed           | the client hung up (logged; nobody receives it)                         |
| 500    | internal_error          | a bug in tokenmill (the connection is closed after it)                  |
| 500    | request_failed          | the engine failed this request alone (it went on with the others)       |
| 503    | engine_dead             | the engine core is gone                                                 |
| 503    | shutting_down           | the server is stopping (lifecycle.py) and takes no new requests         |
| 502    | worker_failed           | `tokenmill router`: the replica serving a stream failed mid-way         |
| 503    | no_workers              | `tokenmill router`: no healthy replica could serve the request          |
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from tokenmill.entrypoints.openai.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

ERROR_CODES: dict[str, int] = {
    "invalid_request": 400, "invalid_value": 400, "unknown_parameter": 400, "unsupported_parameter": 400,
    "context_length_exceeded": 400, "too_many_sequences": 400, "invalid_api_key": 401, "model_not_found": 404,
    "response_not_found": 404, "file_not_found": 404, "batch_not_found": 404, "invalid_file": 400,
    "file_too_large": 400, "batch_not_cancellable": 409, "not_found": 404, "method_not_allowed": 405, "timeout": 408,
    "payload_too_large": 413, "rate_limit_exceeded": 429, "client_closed": 499, "internal_error": 500,
    "request_failed": 500, "engine_dead": 503, "shutting_down": 503,
    "worker_failed": 502, "no_workers": 503,
}
_TYPES = {401: "authentication_error", 408: "timeout_error", 429: "rate_limit_error", 500: "server_error",
          502: "server_error", 503: "server_error"}

_UNION_FIELDS = {
    "prompt": "prompt must be a non-empty string, a list of them, a list of token ids or a list of token-id lists",
    "stop": "stop must be a non-empty string or a list of them",
}
# pydantic error types about the shape of the body, not a value in it
_MAP_FIELDS = ("logit_bias", "chat_template_kwargs")
_SHAPE_ERRORS = ("json_invalid", "missing", "model_attributes_type", "model_type", "dict_type", "list_type",
                 "union_tag_invalid")


def _is_type_tag(part: object) -> bool:
    """pydantic names the union member in an error's loc ('str', 'list[int]', 'constrained-str', 'TextPart')."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part
                                      or part.startswith("constrained-") or part[:1].isupper())


class APIError(Exception):
    def __init__(self, code: str, message: str, param: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        message, param = _encodable(message), None if param is None else _encodable(param)
        super().__init__(message)
        self.status = ERROR_CODES[code]
        self.code = code
        self.message = message
        self.type = _TYPES.get(self.status, "invalid_request_error")
        self.param = param
        self.headers = headers

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param,
                                             code=self.code))

    def response(self) -> JSONResponse:
        return JSONResponse(self.body().model_dump(), status_code=self.status, headers=self.headers)


def _encodable(text: str) -> str:
    """Text that encodes as UTF-8: a lone surrogate from a request, quoted in an error, is escaped."""
    return text if text.isascii() else text.encode("utf-8", "backslashreplace").decode()


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(code, message, param)


def from_validation(exc: RequestValidationError) -> APIError:
    errors: list[Any] = list(exc.errors())
    if not errors:
        return bad_request("invalid request", code="invalid_request")
    err = max(errors, key=lambda e: len(e.get("loc", ())))  # the deepest is the most specific
    loc = [str(x) for x in err.get("loc", ()) if x != "body" and not _is_type_tag(x)]
    field = ".".join(loc) or None
    param = _param(loc)
    kind = err.get("type", "")
    ctx = err.get("ctx") or {}
    code = "invalid_request" if kind in _SHAPE_ERRORS or kind.endswith("_type") else "invalid_value"
    if kind == "unsupported_field":
        return bad_request(str(err.get("msg")), ctx.get("field"), "unsupported_parameter")
    if kind == "invalid_unicode":
        return bad_request(str(err.get("msg")), _param(str(ctx.get("field")).split(".")))
    if kind == "one_input":
        return bad_request(str(err.get("msg")), "prompt", "invalid_request")
    if kind == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {field}", field, "unknown_parameter")
    if kind == "json_invalid":
        return bad_request(f"the request body is not valid JSON: {ctx.get('error', err.get('msg'))}",
                           code=code)
    if kind == "missing":
        if not loc:
            return bad_request("the request needs a JSON body", code=code)
        return bad_request(f"'{field}' is a required property", param, code)
    if kind == "model_attributes_type" and not loc:
        return bad_request("the request body must be a JSON object", code=code)
    if loc and loc[0] in _UNION_FIELDS and len(loc) > 1:
        return bad_request(_UNION_FIELDS[loc[0]], loc[0], code)
    return bad_request(f"{field}: {err.get('msg')}" if field else str(err.get("msg")), param, code)


def _param(loc: list[str]) -> str | None:
    """The parameter an error is about: the field, not an index or key inside a list or a map
    (stop_token_ids.0 is stop_token_ids; messages.0.content stays)."""
    while loc and loc[-1].isdigit():
        loc = loc[:-1]
    return ".".join(loc[:1] if loc and loc[0] in _MAP_FIELDS else loc) or None


def from_http(request: Request, exc: StarletteHTTPException) -> APIError:
    if exc.status_code == 404:
        return APIError("not_found", f"no route {request.method} {request.url.path}")
    if exc.status_code == 405:
        return APIError("method_not_allowed", f"method {request.method} is not allowed on {request.url.path}",
                        headers={"Allow": ", ".join(sorted(_allowed_methods(request)))})
    if exc.status_code == 400:  # FastAPI's own: a body it could not parse
        return bad_request("the request body could not be parsed as JSON", code="invalid_request")
    status = {v: k for k, v in reversed(list(ERROR_CODES.items()))}
    return APIError(status.get(exc.status_code, "internal_error"), str(exc.detail), headers=exc.headers)


def _allowed_methods(request: Request) -> set[str]:
    """Every method some route serves this path with (Starlette's 405 names only the first route's)."""
    methods: set[str] = set()
    for route in request.app.router.routes:
        match, _ = route.matches(request.scope)
        if match != Match.NONE:
            methods |= getattr(route, "methods", None) or set()
    return methods


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return from_validation(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return from_http(request, exc).response()
