"""A tiny fake OpenAI-compatible streaming server on 127.0.0.1 (plain asyncio, HTTP/1.1, chunked SSE)
whose behaviour each request picks with the first number of its prompt:

  900  -> HTTP 500 with an OpenAI error body
  901  -> two chunks, then the connection drops mid-stream (a broken chunked body)
  902  -> one chunk, then an error event
  903  -> a normal stream without the usage chunk
  else -> wait that many ms, then max_tokens chunks `ITL_S` apart, usage, [DONE]

Chat streams start with a role-only chunk (empty content), as vLLM's do; it carries no output.
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

ITL_S = 0.02


class FakeOpenAIServer:
    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> FakeOpenAIServer:
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()
        server.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode().split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
                body = await reader.readexactly(int(headers.get("content-length", 0)))
                if method == "GET" and path == "/v1/models":
                    self._send_json(writer, 200, {"object": "list", "data": [{"id": "fake-model"}]})
                elif method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
                    if not await self._stream(writer, json.loads(body), chat="chat" in path):
                        return
                else:
                    self._send_json(writer, 404, {"error": {"message": "not found"}})
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    @staticmethod
    def _send_json(writer: asyncio.StreamWriter, status: int, obj: dict[str, Any]) -> None:
        data = json.dumps(obj).encode()
        writer.write(f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(data)}\r\n\r\n".encode() + data)

    async def _stream(self, writer: asyncio.StreamWriter, body: dict[str, Any], chat: bool) -> bool:
        """Answers one streamed request; False when the connection was dropped on purpose."""
        self.bodies.append(body)
        prompt = body["messages"][0]["content"] if chat else body["prompt"]
        code = int(prompt[0] if isinstance(prompt, list) else prompt.split()[0])
        n = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
        if code == 900:
            self._send_json(writer, 500, {"error": {"message": "boom", "type": "server_error", "code": 500}})
            return True
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")

            def event(obj: Any) -> None:
                data = f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()
                writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")

            def choice(i: int) -> dict[str, Any]:
                finish = "length" if i == n - 1 else None
                if chat:
                    return {"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": finish}
                return {"index": 0, "text": f"t{i} ", "finish_reason": finish}

            if chat:
                event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            await writer.drain()
            await asyncio.sleep(code / 1000 if code < 900 else 0.01)
            for i in range(n):
                if i:
                    await asyncio.sleep(ITL_S)
                event({"object": "chunk", "choices": [choice(i)]})
                await writer.drain()
                if code == 901 and i == 1:
                    return False  # the caller closes the socket without the final zero-length chunk
                if code == 902:
                    event({"error": {"message": "engine died", "code": 500}})
                    break
            if code != 903:
                prompt_tokens = len(prompt) if isinstance(prompt, list) else len(prompt.split())
                event({"choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                                                "total_tokens": prompt_tokens + n}})
            event("[DONE]")
            writer.write(b"0\r\n\r\n")
            return True
        finally:
            self.in_flight -= 1
