"""One streamed OpenAI-style request, timed: TTFT, the gaps between chunks that carry output, E2E
latency and token counts. Failures (HTTP status other than 200, an error event, a broken or
truncated stream) are returned as a result with `error` set, never raised."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from tokenmill.bench.serve_data import ServeRequest


@dataclass
class RequestResult:
    start_s: float  # when it was sent, seconds after the benchmark began
    prompt_len: int | None  # from usage, else what the client knows
    output_tokens: int = 0  # from usage, else the chunks that carried output
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float = 0.0
    chunks: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass(frozen=True)
class RequestOptions:
    endpoint: str  # /v1/completions or /v1/chat/completions
    model: str
    temperature: float | None
    ignore_eos: bool
    extra_body: dict[str, Any]

    @property
    def chat(self) -> bool:
        return "chat" in self.endpoint


def request_body(req: ServeRequest, opts: RequestOptions) -> dict[str, Any]:
    body: dict[str, Any] = {"model": opts.model, "stream": True, "stream_options": {"include_usage": True}}
    if opts.chat:
        if not isinstance(req.prompt, str):
            raise ValueError("the chat endpoint needs text prompts: pass --tokenizer DIR or a JSONL with 'prompt'")
        body["messages"] = [{"role": "user", "content": req.prompt}]
        body["max_completion_tokens"] = req.max_tokens
    else:
        body["prompt"] = req.prompt
        body["max_tokens"] = req.max_tokens
    if opts.temperature is not None:
        body["temperature"] = opts.temperature
    if opts.ignore_eos:
        body["ignore_eos"] = True
    return {**body, **opts.extra_body}


def _chunk_output(choice: dict[str, Any], chat: bool) -> bool:
    """Whether a streamed choice carries output (text or token ids), not just a finish reason."""
    if chat:
        delta = choice.get("delta") or {}
        text = delta.get("content") or delta.get("reasoning_content")
    else:
        text = choice.get("text")
    return bool(text) or bool(choice.get("token_ids"))


def _error_text(payload: Any) -> str:
    err = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(err, dict):
        return str(err.get("message") or err)
    return str(err or payload)[:200]


async def send(client: httpx.AsyncClient, req: ServeRequest, opts: RequestOptions, t_begin: float) -> RequestResult:
    body = request_body(req, opts)
    start = time.perf_counter()
    res = RequestResult(start_s=start - t_begin, prompt_len=req.prompt_len)
    usage_tokens: int | None = None
    finished = False
    try:
        async with client.stream("POST", opts.endpoint, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode("utf-8", "replace")
                try:
                    detail = _error_text(json.loads(text))
                except ValueError:
                    detail = text[:200]
                res.error = f"HTTP {resp.status_code}: {detail}"
                return res
            last = start
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, comments, event names
                data = line[5:].strip()
                if data == "[DONE]":
                    finished = True
                    break
                payload = json.loads(data)
                if not isinstance(payload, dict) or "error" in payload:
                    res.error = f"error event: {_error_text(payload)}"
                    return res
                now = time.perf_counter()
                for choice in payload.get("choices") or []:
                    finished = finished or choice.get("finish_reason") is not None
                    if _chunk_output(choice, opts.chat):
                        if res.ttft_s is None:
                            res.ttft_s = now - start
                        else:
                            res.itl_s.append(now - last)
                        last = now
                        res.chunks += 1
                        break
                usage = payload.get("usage")
                if isinstance(usage, dict):
                    usage_tokens = usage.get("completion_tokens", usage_tokens)
                    res.prompt_len = usage.get("prompt_tokens", res.prompt_len)
    except (httpx.HTTPError, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"[:200]
        return res
    res.e2e_s = time.perf_counter() - start
    if not finished:
        res.error = "stream ended before [DONE] or a finish_reason"
    res.output_tokens = usage_tokens if usage_tokens is not None else res.chunks
    return res
