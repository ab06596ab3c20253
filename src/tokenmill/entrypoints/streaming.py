"""A streaming HTTP response that stops its body as soon as the client disconnects.

Starlette's StreamingResponse stops a body by cancelling it from an anyio task group. anyio hands that
cancellation to the streaming task only at a moment when the future the task waits on is not yet done.
A body fed on every turn of the event loop (a fast engine ahead of the API process) always has its next
item ready at those moments, so it never gets the cancellation and runs to its end after the client has
left, with its engine requests still decoding. Here the disconnect cancels the streaming task directly
(asyncio delivers a task's cancellation at its next resumption, ready result or not), and the body loop
also checks for the disconnect between chunks. Closing the body runs its cleanup, which aborts the
requests it streams."""

from __future__ import annotations

import asyncio
import contextlib

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


class AbortingStreamingResponse(StreamingResponse):
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await super().__call__(scope, receive, send)
            return
        gone = asyncio.Event()
        streaming = asyncio.ensure_future(self._stream(send, gone))

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()
            streaming.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            await streaming
        except asyncio.CancelledError:
            if not gone.is_set():
                raise  # the server's own cancellation, not the client leaving
        finally:
            watcher.cancel()
            streaming.cancel()
        if self.background is not None and not gone.is_set():
            await self.background()

    async def _stream(self, send: Send, gone: asyncio.Event) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in self.body_iterator:
                if gone.is_set():
                    return
                data = chunk if isinstance(chunk, bytes | memoryview) else chunk.encode(self.charset)
                await send({"type": "http.response.body", "body": data, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # (ASGI 2.4 servers: a send to a closed connection raises)
            gone.set()
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()
