"""Tool-call parsers (`--tool-call-parser NAME`): each turns a model's text into content and tool calls in
its model family's format. A registry by name, imported lazily."""

from __future__ import annotations

import importlib

from tokenmill.entrypoints.openai.tool_parsers.base import ExtractedToolCalls, ParsedCall, ToolParser

_PARSERS = {
    "hermes": ("hermes", "HermesToolParser"),
    "llama3_json": ("llama3_json", "Llama3JsonToolParser"),
    "mistral": ("mistral", "MistralToolParser"),
    "pythonic": ("pythonic", "PythonicToolParser"),
}
TOOL_PARSERS = tuple(_PARSERS)


def get_tool_parser(name: str) -> ToolParser:
    if name not in _PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {', '.join(TOOL_PARSERS)}")
    module, cls = _PARSERS[name]
    parser: ToolParser = getattr(importlib.import_module(f"{__name__}.{module}"), cls)()
    return parser


__all__ = ["TOOL_PARSERS", "ExtractedToolCalls", "ParsedCall", "ToolParser", "get_tool_parser"]
