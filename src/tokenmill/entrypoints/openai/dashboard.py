"""`/dashboard`: the live view of the engine, static files shipped in the package
(tokenmill/metrics/dashboard/) fed by `/dashboard/events`, a server-sent-events stream of
metrics/live.py's snapshot every EVENT_INTERVAL_S, and `/dashboard/snapshot.json`, one snapshot.

With --api-key these routes take the key as `Authorization: Bearer KEY`, or (browsers cannot set
headers on an EventSource) as `?api_key=KEY` or the `tokenmill_api_key` cookie, which `/dashboard?api_key=KEY`
sets (HttpOnly, SameSite=Strict, path /dashboard); middleware.py checks them."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse

from tokenmill.entrypoints.openai.errors import APIError
from tokenmill.entrypoints.openai.middleware import DASHBOARD_COOKIE
from tokenmill.metrics.live import LiveStats

EVENT_INTERVAL_S = 1.0
STATIC = {"dashboard.js": "text/javascript; charset=utf-8", "dashboard.css": "text/css; charset=utf-8"}


def _asset(name: str) -> bytes:
    return resources.files("tokenmill.metrics").joinpath("dashboard", name).read_bytes()


def register(app: FastAPI, live: LiveStats, stopping: Callable[[], bool]) -> None:
    @app.get("/dashboard", response_class=HTMLResponse, include_in_schema=False)
    async def dashboard(request: Request) -> Response:
        if not request.url.path.endswith("/"):  # the page's relative URLs resolve under /dashboard/
            query = f"?{request.url.query}" if request.url.query else ""
            return Response(status_code=307, headers={"location": f"/dashboard/{query}"})
        return await dashboard_page(request)

    @app.get("/dashboard/", response_class=HTMLResponse, include_in_schema=False)
    async def dashboard_page(request: Request) -> Response:
        response = HTMLResponse(_asset("index.html"))
        key = request.query_params.get("api_key")
        if key:
            response.set_cookie(DASHBOARD_COOKIE, key, httponly=True, samesite="strict", path="/dashboard")
        return response

    @app.get("/dashboard/static/{name}", include_in_schema=False)
    async def static(name: str) -> Response:
        if name not in STATIC:
            return APIError("not_found", f"no dashboard file {name!r}").response()
        return Response(_asset(name), media_type=STATIC[name], headers={"cache-control": "no-cache"})

    @app.get("/dashboard/snapshot.json", include_in_schema=False)
    async def snapshot() -> JSONResponse:
        return JSONResponse(live.snapshot(time.time()))

    @app.get("/dashboard/events", include_in_schema=False)
    async def events(request: Request) -> StreamingResponse:
        async def stream() -> AsyncIterator[str]:
            while not stopping() and not await request.is_disconnected():
                yield f"data: {json.dumps(live.snapshot(time.time()), allow_nan=False)}\n\n"
                await asyncio.sleep(EVENT_INTERVAL_S)

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache", "x-accel-buffering": "no"})
