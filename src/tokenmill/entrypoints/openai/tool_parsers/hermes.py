"""Hermes / Qwen: each call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`."""

from __future__ import annotations

import json
import re

from tokenmill.entrypoints.openai.tool_parsers.base import ExtractedToolCalls, ToolParser, call_of

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


class HermesToolParser(ToolParser):
    start = "<tool_call>"
    call_format = '<tool_call>\n{"name": <function name>, "arguments": <arguments object>}\n</tool_call>'

    def extract(self, text: str) -> ExtractedToolCalls:
        at = text.find(self.start)
        if at < 0:
            return ExtractedToolCalls(text)
        calls = []
        for body in _CALL.findall(text[at:]):
            try:
                call = call_of(json.loads(body))
            except ValueError:
                call = None
            if call is not None:
                calls.append(call)
        if not calls:
            return ExtractedToolCalls(text)
        return ExtractedToolCalls(text[:at] or None, calls)
