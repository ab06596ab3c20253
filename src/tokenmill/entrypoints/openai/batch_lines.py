"""One batch line: checking an input line (OpenAI's batch input format), and running it through the
server's own app in-process, so that a line gets exactly the answer (status and body) the same request
sent online gets. Shared by the server's batch runner and `tokenmill run-batch`."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message

from tokenmill.entrypoints.openai.batch_store import new_id
from tokenmill.entrypoints.openai.middleware import BATCH_SCOPE_KEY

BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")


@dataclass(frozen=True)
class ParsedLine:
    custom_id: str | None
    body: str | None  # the request body to send (JSON), None for a malformed line
    error: dict[str, Any] | None  # the line's error record, for a malformed line

    @property
    def error_record(self) -> dict[str, Any]:
        return {"id": new_id("batch_req_"), "custom_id": self.custom_id, "response": None, "error": self.error}


def parse_line(text: str, endpoint: str | None, seen: set[str]) -> ParsedLine:
    """An input line `{"custom_id", "method": "POST", "url", "body"}`; `endpoint` None: any of
    BATCH_ENDPOINTS (run-batch), else the batch's. A malformed line becomes an error, never an exception."""
    try:
        line = json.loads(text)
    except ValueError as e:
        return _bad(None, "invalid_json", f"the line is not valid JSON: {e}")
    if not isinstance(line, dict):
        return _bad(None, "invalid_request", "the line must be a JSON object with custom_id, method, url and body")
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return _bad(None, "invalid_request", "custom_id must be a non-empty string")
    if custom_id in seen:
        return _bad(custom_id, "duplicate_custom_id", f"custom_id {custom_id!r} appears more than once in the file")
    seen.add(custom_id)
    if line.get("method", "POST") != "POST":
        return _bad(custom_id, "invalid_request", f"method must be POST, got {line.get('method')!r}")
    url = line.get("url")
    allowed = BATCH_ENDPOINTS if endpoint is None else (endpoint,)
    if url not in allowed:
        return _bad(custom_id, "invalid_url", f"url {url!r} is not this batch's endpoint ({' or '.join(allowed)})")
    body = line.get("body")
    if not isinstance(body, dict):
        return _bad(custom_id, "invalid_request", "body must be a JSON object (the request)")
    if body.get("stream"):
        return _bad(custom_id, "unsupported_parameter", "stream is not supported in a batch")
    return ParsedLine(custom_id, json.dumps({"url": url, "body": body}), None)


def _bad(custom_id: str | None, code: str, message: str) -> ParsedLine:
    return ParsedLine(custom_id, None, {"code": code, "message": message})


@dataclass(frozen=True)
class Answer:
    status: int
    request_id: str | None
    body: Any

    @property
    def retry(self) -> bool:
        """429 (queue full): try the line again later; 503 (engine dead, shutting down): leave it for a
        restart. Neither is the line's answer."""
        return self.status in (429, 503)

    def record(self, custom_id: str) -> dict[str, Any]:
        return {"id": new_id("batch_req_"), "custom_id": custom_id,
                "response": {"status_code": self.status, "request_id": self.request_id, "body": self.body},
                "error": None}


async def call_app(app: ASGIApp, request: str, batch_id: str) -> Answer:
    """POSTs a line's body (`request`: {"url", "body"} as stored) to `app` in-process. The scope names
    the batch: the key check is skipped (the batch's owner was checked when it was created) and the
    request runs in the batch priority class. Cancelling this aborts the request in the engine."""
    parsed = json.loads(request)
    path: str = parsed["url"]
    payload = json.dumps(parsed["body"]).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())],
             "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0), BATCH_SCOPE_KEY: batch_id}
    body_sent = False
    status = 500
    headers: dict[bytes, bytes] = {}
    chunks: list[bytes] = []

    async def receive() -> Message:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": payload, "more_body": False}
        await asyncio.Event().wait()  # the client never leaves; cancelling the call ends the wait
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        nonlocal status, headers
        if message["type"] == "http.response.start":
            status = int(message["status"])
            headers = {k.lower(): v for k, v in message.get("headers", [])}
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(scope, receive, send)
    raw = b"".join(chunks)
    try:
        body = json.loads(raw)
    except ValueError:
        body = raw.decode("utf-8", "replace")
    request_id = headers.get(b"x-request-id")
    return Answer(status, request_id.decode() if request_id else None, body)
