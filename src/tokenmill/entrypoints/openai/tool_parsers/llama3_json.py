"""Llama 3.x JSON tool calls: the answer is `{"name": ..., "parameters": {...}}` (optionally after
`<|python_tag|>`), several separated by `;`."""

from __future__ import annotations

import json

from tokenmill.entrypoints.openai.tool_parsers.base import ExtractedToolCalls, ToolParser, call_of

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    start = "{"
    call_format = '{"name": <function name>, "parameters": <arguments object>}'
    at_start_only = True

    def call_start(self, text: str) -> int:
        stripped = text.lstrip()
        if stripped.startswith(PYTHON_TAG):
            return len(text) - len(stripped)
        return super().call_start(text)

    def may_start(self, text: str) -> bool:
        rest = text.lstrip()
        return super().may_start(text) or PYTHON_TAG.startswith(rest)

    def extract(self, text: str) -> ExtractedToolCalls:
        body = text.strip()
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG):].lstrip()
        if not body.startswith("{"):
            return ExtractedToolCalls(text)
        decoder, calls, pos = json.JSONDecoder(), [], 0
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except ValueError:
                return ExtractedToolCalls(text)
            call = call_of(obj, "parameters")
            if call is None:
                return ExtractedToolCalls(text)
            calls.append(call)
            pos = end
            while pos < len(body) and body[pos] in " \t\r\n;":
                pos += 1
        return ExtractedToolCalls(None, calls)
