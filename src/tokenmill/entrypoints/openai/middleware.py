"""The server's outermost ASGI layer: the API key (401), the body-size limit (413, also for a
chunked body), X-Request-Id echoed on every response, and a bug in a handler turned into an
OpenAI-shaped 500 that closes the connection (never a reset connection a client cannot tell
from a network failure)."""

from __future__ import annotations

import logging
import secrets
from collections.abc import Mapping, Sequence
from http.cookies import CookieError, SimpleCookie
from urllib.parse import parse_qs

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenmill.entrypoints.openai.errors import APIError

logger = logging.getLogger(__name__)

# what needs no API key: probes and monitoring (everything else, /docs and /openapi.json too, does)
OPEN_PATHS = frozenset({"/health", "/ping", "/metrics", "/version"})
REQUEST_ID_HEADER = b"x-request-id"
# an ASGI scope key the batch runner sets on the requests it makes in-process (an HTTP client cannot set
# it): the batch's id. Such a request skips the key check (its batch's owner was checked when the batch was
# created) and runs in the batch priority class, taking turns with other batches
BATCH_SCOPE_KEY = "tokenmill.batch_id"
# the dashboard's routes also take the key as ?api_key= or this cookie: a browser's EventSource sends no headers
DASHBOARD_PREFIX = "/dashboard"
DASHBOARD_COOKIE = "tokenmill_api_key"


def bearer_token(value: bytes) -> bytes | None:
    """The token of an `Authorization: Bearer TOKEN` header; the scheme is case-insensitive (RFC 9110)."""
    scheme, _, token = value.strip().partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" else None


def api_keys(api_key: str | Sequence[str] | None) -> tuple[str, ...]:
    """--api-key's value as a tuple of keys (it takes one or more; each one is a caller)."""
    if not api_key:
        return ()
    return (api_key,) if isinstance(api_key, str) else tuple(k for k in api_key if k)


class GuardMiddleware:
    def __init__(self, app: ASGIApp, api_key: str | Sequence[str] | None, max_body_bytes: int,
                 path_body_bytes: Mapping[str, int] | None = None) -> None:
        self.app = app
        self.api_keys = [k.encode() for k in api_keys(api_key)]
        self.default_max_body_bytes = max_body_bytes
        self.path_body_bytes = dict(path_body_bytes or {})  # routes with their own limit (file uploads)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        request_id = headers.get(REQUEST_ID_HEADER)
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if request_id is not None and not any(k.lower() == REQUEST_ID_HEADER for k, _ in message["headers"]):
                    message = {**message, "headers": [*message["headers"], (REQUEST_ID_HEADER, request_id)]}
            await send(message)

        error = None if BATCH_SCOPE_KEY in scope else self._check_key(scope["path"], headers,
                                                                       scope.get("query_string", b""))
        if error is None:
            limit = self.path_body_bytes.get(scope["path"], self.default_max_body_bytes)
            error, receive = await self._check_size(headers, receive, limit)
        if error is not None:
            await send_error(send_with_id, error)
            return
        try:
            await self.app(scope, receive, send_with_id)
        except Exception as e:
            if started:
                raise  # mid-response: the server can only drop the connection
            logger.exception("unhandled error in %s %s", scope["method"], scope["path"])
            await send_error(send_with_id, APIError("internal_error", f"internal server error: {type(e).__name__}"),
                             close=True)

    def _check_key(self, path: str, headers: dict[bytes, bytes], query: bytes = b"") -> APIError | None:
        if not self.api_keys or path in OPEN_PATHS:
            return None
        value = headers.get(b"authorization")
        token = bearer_token(value) if value is not None else None
        if token is None and path.startswith(DASHBOARD_PREFIX):
            token = dashboard_key(headers, query)
            value = value if token is None else token
        # every key compared, so the time taken does not tell which one matched
        if token is not None and sum(secrets.compare_digest(token, key) for key in self.api_keys):
            return None
        if value is None:
            return APIError("invalid_api_key", "You didn't provide an API key (Authorization: Bearer KEY).")
        return APIError("invalid_api_key", "Incorrect API key provided.")

    async def _check_size(self, headers: dict[bytes, bytes], receive: Receive,
                          max_body_bytes: int) -> tuple[APIError | None, Receive]:
        """A declared length over the limit is refused at once; a chunked body is read up to the
        limit first (the app reads all of it anyway) and then replayed to the app."""
        length = headers.get(b"content-length")
        if length is not None:
            if length.isdigit() and int(length) > max_body_bytes:
                return _too_large(f"the request body is {int(length)} bytes", max_body_bytes), receive
            return None, receive
        if b"chunked" not in headers.get(b"transfer-encoding", b"").lower():
            return None, receive
        body: list[bytes] = []
        seen = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return None, _replay([message], receive)  # a disconnect: the app sees it
            seen += len(message.get("body", b""))
            if seen > max_body_bytes:
                return _too_large(f"the request body is over {max_body_bytes} bytes", max_body_bytes), receive
            body.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        return None, _replay([{"type": "http.request", "body": b"".join(body), "more_body": False}], receive)


def _too_large(what: str, limit: int) -> APIError:
    return APIError("payload_too_large", f"{what}; the limit is {limit} (--max-request-bytes)")


def _replay(messages: list[Message], receive: Receive) -> Receive:
    async def replayed() -> Message:
        return messages.pop(0) if messages else await receive()

    return replayed


async def send_error(send: Send, error: APIError, close: bool = False) -> None:
    body = error.body().model_dump_json().encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in (error.headers or {}).items()]
    if close or error.status == 413:  # 413: the rest of the body is unread, so the connection cannot be reused
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def dashboard_key(headers: dict[bytes, bytes], query: bytes) -> bytes | None:
    """The key a dashboard route was given as ?api_key=KEY or in the dashboard's cookie, if any."""
    given = parse_qs(query.decode("latin-1")).get("api_key")
    if given:
        return given[0].encode()
    cookie = headers.get(b"cookie")
    if cookie is None:
        return None
    jar: SimpleCookie = SimpleCookie()
    try:
        jar.load(cookie.decode("latin-1"))
    except CookieError:
        return None
    morsel = jar.get(DASHBOARD_COOKIE)
    return None if morsel is None else morsel.value.encode()
