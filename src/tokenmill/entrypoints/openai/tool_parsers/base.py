"""What a tool-call parser is: text in, the content and the complete calls found in it out."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text of an object


@dataclass
class ExtractedToolCalls:
    content: str | None  # the text that is not a call (None when there is none)
    calls: list[ParsedCall] = field(default_factory=list)


class ToolParser:
    """A parser finds calls in the whole text of an answer. `start` is the text a call (or the block of
    calls) opens with; the streaming front end passes text before it on as content and holds what follows
    it until calls complete. `at_start_only`: calls open the answer (after whitespace) or not at all."""

    start: str = ""
    at_start_only: bool = False
    call_format: str = ""  # how a call is written, for the system prompt of templates without tools

    def extract(self, text: str) -> ExtractedToolCalls:
        raise NotImplementedError

    def call_start(self, text: str) -> int:
        """Where in text the calls begin, or -1 (no call has begun)."""
        if self.at_start_only:
            stripped = len(text) - len(text.lstrip())
            return stripped if text[stripped:].startswith(self.start) else -1
        return text.find(self.start)

    def may_start(self, text: str) -> bool:
        """Whether more text could still open a call at text's end (so the end is held back)."""
        if self.at_start_only:
            rest = text.lstrip()
            return self.start.startswith(rest)
        return any(text.endswith(self.start[:k]) for k in range(1, len(self.start)))


def arguments_json(value: Any) -> str:
    """A call's arguments as JSON text: an object is dumped, a string kept when it is JSON already."""
    if isinstance(value, str):
        try:
            json.loads(value)
            return value
        except ValueError:
            return json.dumps(value)
    return json.dumps({} if value is None else value, ensure_ascii=False)


def call_of(obj: Any, args_key: str = "arguments") -> ParsedCall | None:
    """{"name": ..., "arguments"/"parameters": {...}} as a call, or None when obj is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("parameters", obj.get("arguments")))
    return ParsedCall(obj["name"], arguments_json(args))
