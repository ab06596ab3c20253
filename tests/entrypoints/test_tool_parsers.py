"""The tool-call parsers on text: each family's format gives its calls (name, arguments as JSON) and the
content around them; text that is not a call stays content. Streamed in pieces of every size, the
ToolCallStream passes on the same content and calls as the whole text gives."""

from __future__ import annotations

import json

import pytest

from tokenmill.entrypoints.openai.serving_tools import ToolCallStream, ToolPlan, answer, required_schema
from tokenmill.entrypoints.openai.tool_parsers import TOOL_PARSERS, get_tool_parser
from tokenmill.entrypoints.openai.tool_protocol import ChatTool

CASES = {
    "hermes": [
        ('Sure.<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>', "Sure.", [("f", {"x": 1})]),
        ('<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g", "arguments": {"y": "z"}}'
         "</tool_call>", None, [("f", {}), ("g", {"y": "z"})]),
        ("no call here <tool", "no call here <tool", []),
        ("<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
    ],
    "llama3_json": [
        ('{"name": "f", "parameters": {"x": [1, 2]}}', None, [("f", {"x": [1, 2]})]),
        ('<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"a": true}}', None,
         [("f", {}), ("g", {"a": True})]),
        ("plain words {", "plain words {", []),
        ('{"x": 1}', '{"x": 1}', []),
    ],
    "mistral": [
        ('[TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {}}]', None,
         [("f", {"x": 1}), ("g", {})]),
        ('Let me see. [TOOL_CALLS]f[ARGS]{"x": 2}', "Let me see. ", [("f", {"x": 2})]),
        ("[TOOL_CALLS] garbage", "[TOOL_CALLS] garbage", []),
    ],
    "pythonic": [
        ('[get_weather(city="Paris", days=3), now()]', None, [("get_weather", {"city": "Paris", "days": 3}),
                                                              ("now", {})]),
        ("[1, 2]", "[1, 2]", []),
        ("[f(x=open('a'))]", "[f(x=open('a'))]", []),
        ("hello", "hello", []),
    ],
}


@pytest.mark.parametrize(("name", "text", "content", "calls"),
                         [(n, *case) for n, cases in CASES.items() for case in cases])
def test_parsers_find_calls_and_content(name: str, text: str, content: str | None,
                                        calls: list[tuple[str, dict[str, object]]]) -> None:
    found = get_tool_parser(name).extract(text)
    assert found.content == content
    assert [(c.name, json.loads(c.arguments)) for c in found.calls] == calls


def test_the_registry_names_every_parser() -> None:
    from tokenmill.entrypoints.cli_serve import TOOL_PARSER_NAMES

    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "mistral", "pythonic"} == set(TOOL_PARSER_NAMES)
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        get_tool_parser("nope")


@pytest.mark.parametrize(("name", "text", "content", "calls"),
                         [(n, *case) for n, cases in CASES.items() for case in cases])
@pytest.mark.parametrize("piece", [1, 3, 1000])
def test_streamed_in_pieces_the_same_as_whole(name: str, text: str, content: str | None,
                                              calls: list[tuple[str, dict[str, object]]], piece: int) -> None:
    stream = ToolCallStream(ToolPlan("auto", parser=get_tool_parser(name)))
    got_content, got_calls = "", []
    for i in range(0, len(text), piece):
        part = text[i:i + piece]
        c, deltas = stream.feed(part, i + piece >= len(text))
        got_content += c or ""
        for d in deltas:
            assert d.index == len(got_calls) and d.id and d.function is not None
            got_calls.append((d.function.name, json.loads(d.function.arguments or "")))
    assert got_content == (content or "") and got_calls == calls
    whole_content, whole_calls = answer(ToolPlan("auto", parser=get_tool_parser(name)), text)
    assert whole_content == content and len(whole_calls) == len(calls)


def test_content_streams_before_a_call_begins() -> None:
    stream = ToolCallStream(ToolPlan("auto", parser=get_tool_parser("hermes")))
    assert stream.feed("Hello <tool", False) == ("Hello ", [])  # "<tool" may open a call: held
    assert stream.feed("box> there", False) == ("<toolbox> there", [])
    content, calls = stream.feed('<tool_call>{"name": "f", "arguments": {}}</tool_call>', True)
    assert content is None and [d.function.name for d in calls if d.function] == ["f"]


def test_named_choice_streams_the_arguments_as_they_come() -> None:
    stream = ToolCallStream(ToolPlan("named", named="f"))
    first = stream.feed('{"a"', False)[1]
    assert first[0].id and first[0].function is not None and first[0].function.name == "f"
    rest = stream.feed(": 1}", True)[1]
    assert rest[0].id is None and rest[0].function is not None and rest[0].function.arguments == ": 1}"


def test_required_schema_lists_calls_of_the_given_functions() -> None:
    tools = [ChatTool.model_validate({"type": "function", "function": {"name": n, "parameters": {
        "type": "object", "properties": {"v": {"type": "integer"}}, "required": ["v"]}}}) for n in ("f", "g")]
    schema = required_schema(tools, parallel=False)
    import jsonschema

    jsonschema.validate([{"name": "g", "parameters": {"v": 3}}], schema)
    for bad in ([], [{"name": "h", "parameters": {"v": 3}}], [{"name": "f", "parameters": {}}],
                [{"name": "f", "parameters": {"v": 1}}] * 2):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
