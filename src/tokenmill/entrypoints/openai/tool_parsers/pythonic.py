"""Pythonic tool calls (Llama 3.2, ToolACE): the answer is a Python list of calls with keyword
arguments of literal values, `[get_weather(city="Paris"), get_time()]`."""

from __future__ import annotations

import ast
import json
from typing import Any

from tokenmill.entrypoints.openai.tool_parsers.base import ExtractedToolCalls, ParsedCall, ToolParser


class PythonicToolParser(ToolParser):
    start = "["
    call_format = '[function_name(argument=value, ...)]'
    at_start_only = True

    def extract(self, text: str) -> ExtractedToolCalls:
        body = text.strip()
        if not body.startswith("["):
            return ExtractedToolCalls(text)
        try:
            tree = ast.parse(body, mode="eval").body
        except SyntaxError:
            return ExtractedToolCalls(text)
        if not isinstance(tree, ast.List) or not tree.elts:
            return ExtractedToolCalls(text)
        calls = []
        for node in tree.elts:
            call = _call(node)
            if call is None:
                return ExtractedToolCalls(text)
            calls.append(call)
        return ExtractedToolCalls(None, calls)


def _call(node: ast.expr) -> ParsedCall | None:
    if not isinstance(node, ast.Call) or node.args:
        return None
    name = _dotted(node.func)
    if name is None:
        return None
    args: dict[str, Any] = {}
    for kw in node.keywords:
        if kw.arg is None:
            return None
        try:
            args[kw.arg] = ast.literal_eval(kw.value)
        except (ValueError, TypeError, SyntaxError):
            return None
    return ParsedCall(name, json.dumps(args, ensure_ascii=False))


def _dotted(func: ast.expr) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        head = _dotted(func.value)
        return None if head is None else f"{head}.{func.attr}"
    return None
