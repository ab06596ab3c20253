"""OpenAI's Files and Batch API: /v1/files (upload, list, retrieve, content, delete) and /v1/batches
(create, retrieve, list, cancel), in OpenAI's shapes, so the `openai` client works unmodified. With
--api-key each file and batch belongs to the key that made it (the store keeps a SHA-256 of the key,
never the key); another key's ids are 404."""

from __future__ import annotations

import hashlib
import json
import re
import sqlite3
import time
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Query, Request
from fastapi.responses import FileResponse, JSONResponse
from pydantic import Field

from tokenmill.entrypoints.openai.batch_config import BatchConfig
from tokenmill.entrypoints.openai.batch_lines import BATCH_ENDPOINTS
from tokenmill.entrypoints.openai.batch_runner import BatchRunner
from tokenmill.entrypoints.openai.batch_store import BatchStore
from tokenmill.entrypoints.openai.errors import APIError, bad_request
from tokenmill.entrypoints.openai.middleware import api_keys, bearer_token
from tokenmill.entrypoints.openai.openapi import errors
from tokenmill.entrypoints.openai.request_types import OpenAIRequest

MULTIPART_OVERHEAD = 2**20  # the part headers and boundaries of an upload, beside the file itself
WINDOW_PATTERN = r"^([1-9][0-9]{0,6})(s|m|h|d)$"
_WINDOW = re.compile(WINDOW_PATTERN)
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
UPLOAD_PURPOSES = ("batch",)
BatchEndpoint = Literal["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]
assert set(BatchEndpoint.__args__) == set(BATCH_ENDPOINTS)  # type: ignore[attr-defined]


class BatchCreateRequest(OpenAIRequest):
    input_file_id: Annotated[str, Field(min_length=1, max_length=128)]
    endpoint: BatchEndpoint
    completion_window: Annotated[str, Field(pattern=WINDOW_PATTERN)] = "24h"
    metadata: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | None = None


def completion_window_seconds(window: str) -> int:
    """OpenAI's "24h", and other whole durations in s, m, h or d ("10m", "1h")."""
    match = _WINDOW.match(window)
    if match is None:
        raise bad_request(f"completion_window must be a duration such as 24h (OpenAI's), 1h or 10m; got {window!r}",
                          "completion_window")
    return int(match.group(1)) * _SECONDS[match.group(2)]


_UPLOAD_SCHEMA: dict[str, Any] = {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
    "type": "object", "required": ["file", "purpose"],
    "properties": {"file": {"type": "string", "format": "binary", "description": "JSONL, one request a line"},
                   "purpose": {"type": "string", "enum": list(UPLOAD_PURPOSES)}}}}}}}


def owner_key(raw: Request, keys_set: bool) -> str:
    """Who owns what this request makes or may see: a SHA-256 of its API key ("" without --api-key)."""
    if not keys_set:
        return ""
    value = raw.headers.get("authorization", "")
    token = bearer_token(value.encode()) or b""
    return hashlib.sha256(token).hexdigest()


def check_jsonl(content: bytes) -> None:
    """An upload must be UTF-8 JSON Lines with at least one JSON object line (a malformed line among them
    is the batch's business: it goes to the error file)."""
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(f"the file is not JSONL: it is not UTF-8 text (byte {e.start})", "file",
                          "invalid_file") from None
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            if isinstance(json.loads(line), dict):
                return
        except ValueError:
            continue
    raise bad_request("the file is not JSONL: no line of it is a JSON object", "file", "invalid_file")


def list_page(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}


def open_runner(config: BatchConfig) -> BatchRunner:
    try:
        store = BatchStore(config.directory)
    except (OSError, sqlite3.Error) as e:
        raise ValueError(f"--batch-dir {config.directory}: cannot keep batches there: {e}") from None
    return BatchRunner(store, lines_in_flight=config.lines_in_flight)


def upload_limits(config: BatchConfig | None, max_request_bytes: int) -> dict[str, int]:
    """/v1/files takes bodies up to the file limit (and the multipart framing): a file over the limit is
    the route's 400, not a 413."""
    if config is None:
        return {}
    return {"/v1/files": max(max_request_bytes, config.max_file_bytes + MULTIPART_OVERHEAD)}


def install(app: FastAPI, runner: BatchRunner, config: BatchConfig | None, api_key: str | list[str] | None) -> None:
    """The routes, and `app` as the one the runner sends the lines through."""
    register(app, runner, config or BatchConfig(str(runner.store.directory)), api_key)
    runner.app = app


def register(app: FastAPI, runner: BatchRunner, config: BatchConfig, api_key: str | list[str] | None) -> None:
    store: BatchStore = runner.store
    keyed = bool(api_keys(api_key))

    def owner(raw: Request) -> str:
        return owner_key(raw, keyed)

    def file_not_found(file_id: str, param: str | None = None) -> APIError:
        return APIError("file_not_found", f"No such File object: {file_id}", param)

    def batch_not_found(batch_id: str) -> APIError:
        return APIError("batch_not_found", f"No such Batch object: {batch_id}")

    @app.post("/v1/files", responses=errors(400, 401, 413), openapi_extra=_UPLOAD_SCHEMA)
    async def upload_file(raw: Request) -> JSONResponse:
        form = await raw.form(max_files=1, max_fields=8)
        try:
            purpose, upload = form.get("purpose"), form.get("file")
            if not isinstance(purpose, str):
                raise bad_request("'purpose' is a required property (batch)", "purpose", "invalid_request")
            if purpose not in UPLOAD_PURPOSES:
                raise bad_request(f"purpose must be 'batch' (the only purpose this server takes files for), got "
                                  f"{purpose!r}", "purpose")
            if upload is None or isinstance(upload, str):
                raise bad_request("'file' is a required property (a multipart file part)", "file", "invalid_request")
            content = await upload.read(config.max_file_bytes + 1)
            if len(content) > config.max_file_bytes:
                raise bad_request(f"the file is over {config.max_file_bytes} bytes (--max-batch-file-bytes)", "file",
                                  "file_too_large")
            check_jsonl(content)
            name = upload.filename or "upload.jsonl"
        finally:
            await form.close()
        return JSONResponse(await runner.db(store.add_file, owner(raw), name, purpose, content))

    @app.get("/v1/files", responses=errors(400, 401))
    async def list_files(raw: Request, purpose: str | None = None, after: str | None = None,
                         limit: Annotated[int, Query(ge=1, le=10000)] = 10000,
                         order: Literal["asc", "desc"] = "desc") -> JSONResponse:
        data, more = await runner.db(store.list_files, owner(raw), purpose, after, limit, order == "desc")
        return JSONResponse(list_page(data, more))

    @app.get("/v1/files/{file_id}", responses=errors(401, 404))
    async def retrieve_file(raw: Request, file_id: str) -> JSONResponse:
        found = await runner.db(store.get_file, owner(raw), file_id)
        if found is None:
            raise file_not_found(file_id)
        return JSONResponse(found)

    @app.get("/v1/files/{file_id}/content", response_class=FileResponse, responses=errors(401, 404))
    async def file_content(raw: Request, file_id: str) -> FileResponse:
        found = await runner.db(store.get_file, owner(raw), file_id)
        if found is None:
            raise file_not_found(file_id)
        return FileResponse(store.path_of(file_id), media_type="application/octet-stream",
                            filename=found["filename"])

    @app.delete("/v1/files/{file_id}", responses=errors(401, 404))
    async def delete_file(raw: Request, file_id: str) -> JSONResponse:
        if not await runner.db(store.delete_file, owner(raw), file_id):
            raise file_not_found(file_id)
        return JSONResponse({"id": file_id, "object": "file", "deleted": True})

    @app.post("/v1/batches", responses=errors(400, 401, 404, 413))
    async def create_batch(raw: Request, req: BatchCreateRequest) -> JSONResponse:
        who = owner(raw)
        window = completion_window_seconds(req.completion_window)
        found = await runner.db(store.get_file, who, req.input_file_id)
        if found is None:
            raise file_not_found(req.input_file_id, "input_file_id")
        if found["purpose"] != "batch":
            raise bad_request(f"the input file's purpose is {found['purpose']!r}, not 'batch'", "input_file_id")
        now = int(time.time())
        batch = await runner.db(store.add_batch, who, {
            "endpoint": req.endpoint, "input_file_id": req.input_file_id, "completion_window": req.completion_window,
            "created_at": now, "expires_at": now + window, "metadata": req.metadata})
        runner.submit(batch["id"])
        return JSONResponse(batch)

    @app.get("/v1/batches", responses=errors(400, 401))
    async def list_batches(raw: Request, after: str | None = None,
                           limit: Annotated[int, Query(ge=1, le=100)] = 20) -> JSONResponse:
        data, more = await runner.db(store.list_batches, owner(raw), after, limit)
        return JSONResponse(list_page(data, more))

    @app.get("/v1/batches/{batch_id}", responses=errors(401, 404))
    async def retrieve_batch(raw: Request, batch_id: str) -> JSONResponse:
        found = await runner.db(store.get_batch, batch_id, owner(raw))
        if found is None:
            raise batch_not_found(batch_id)
        return JSONResponse(found)

    @app.post("/v1/batches/{batch_id}/cancel", responses=errors(401, 404, 409))
    async def cancel_batch(raw: Request, batch_id: str) -> JSONResponse:
        found = await runner.db(store.get_batch, batch_id, owner(raw))
        if found is None:
            raise batch_not_found(batch_id)
        if found["status"] in ("cancelling", "cancelled"):
            return JSONResponse(found)
        moved = await runner.db(store.set_status, batch_id, "cancelling", only_from=("validating", "in_progress"))
        if moved is None:
            raise APIError("batch_not_cancellable", f"Cannot cancel a batch with status {found['status']!r}.")
        runner.cancel(batch_id)
        return JSONResponse(moved)
