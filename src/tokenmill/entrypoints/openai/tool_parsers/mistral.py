"""Mistral: `[TOOL_CALLS]` then a JSON list of `{"name": ..., "arguments": {...}}`, or (newer tokenizers)
`[TOOL_CALLS]name[ARGS]{...}` per call."""

from __future__ import annotations

import json

from tokenmill.entrypoints.openai.tool_parsers.base import (
    ExtractedToolCalls,
    ParsedCall,
    ToolParser,
    arguments_json,
    call_of,
)

ARGS = "[ARGS]"


class MistralToolParser(ToolParser):
    start = "[TOOL_CALLS]"
    call_format = '[TOOL_CALLS][{"name": <function name>, "arguments": <arguments object>}]'

    def extract(self, text: str) -> ExtractedToolCalls:
        at = text.find(self.start)
        if at < 0:
            return ExtractedToolCalls(text)
        content = text[:at] or None
        body = text[at + len(self.start):].strip()
        calls: list[ParsedCall] = []
        if body.startswith("[") or body.startswith("{"):
            try:
                obj = json.loads(body)
            except ValueError:
                return ExtractedToolCalls(text)
            for item in obj if isinstance(obj, list) else [obj]:
                call = call_of(item)
                if call is None:
                    return ExtractedToolCalls(text)
                calls.append(call)
        else:
            for part in body.split(self.start):
                name, sep, args = part.partition(ARGS)
                if not sep or not name.strip():
                    return ExtractedToolCalls(text)
                try:
                    calls.append(ParsedCall(name.strip(), arguments_json(json.loads(args))))
                except ValueError:
                    return ExtractedToolCalls(text)
        return ExtractedToolCalls(content, calls) if calls else ExtractedToolCalls(text)
