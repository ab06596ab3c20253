"""A bug in a handler is an OpenAI-shaped 500 that says `Connection: close`, and the client's next
request works (the connection was once dropped without a word, which a client takes for a network
failure). Served by uvicorn in-process, on 127.0.0.1, with the server's own middleware and error
handlers around a route that raises."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from tests.entrypoints.server import free_port
from tokenmill.entrypoints.openai.app import GuardMiddleware
from tokenmill.entrypoints.openai.errors import install_error_handlers


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    app = FastAPI()
    install_error_handlers(app)
    app.add_middleware(GuardMiddleware, api_key=None, max_body_bytes=1000)

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("a bug")

    @app.get("/ok")
    async def ok() -> dict[str, bool]:
        return {"ok": True}

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


def test_a_bug_is_a_500_that_closes_the_connection(url: str) -> None:
    with httpx.Client(base_url=url, timeout=10) as http:
        for _ in range(2):
            r = http.get("/boom", headers={"X-Request-Id": "r-1"})
            assert r.status_code == 500 and r.headers["connection"] == "close"
            assert r.headers["x-request-id"] == "r-1"
            err = r.json()["error"]
            assert err["code"] == "internal_error" and err["type"] == "server_error"
            assert http.get("/ok").json() == {"ok": True}  # the client reconnects: it was told to
