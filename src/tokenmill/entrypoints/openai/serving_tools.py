"""Structured output and tool calling for the chat endpoint: the request's constraint (response_format,
vLLM's structured_outputs and guided_*), the tool plan (tool_choice), the conversation for the chat
template (tools, assistant tool_calls, tool messages), and the answer's tool calls, whole or streamed.

`required` and a named tool_choice constrain the output with a JSON schema (a list of calls, or the named
function's parameters), so the call is always valid JSON for the function; the arguments are written
compactly (no free whitespace), which the client parses and never shows. `auto` lets the model write
what it likes; the --tool-call-parser finds the calls in its text.

Chat templates that take `tools` render them; for one that does not, the tools are described in a system
message (with the parser's call format), assistant tool calls are written in that format and tool results
become user messages in <tool_response> tags."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from tokenmill.entrypoints.openai.errors import bad_request
from tokenmill.entrypoints.openai.protocol import ChatMessage, SamplingRequest
from tokenmill.entrypoints.openai.tool_parsers import ParsedCall, ToolParser, get_tool_parser
from tokenmill.entrypoints.openai.tool_protocol import (
    ChatTool,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    NamedToolChoice,
    ToolCall,
    ToolChoice,
)
from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.structured.grammar import check_structured_outputs

STRUCTURED_OUTPUT_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                      "guided_grammar")


def structured_outputs_of(req: SamplingRequest, backend: str) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's constraint and the field it came from, checked with the grammar backend's library; a 400
    when more than one is given."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(("response_format", StructuredOutputsParams(json_object=True)))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise bad_request("response_format of type json_schema needs json_schema.schema", "response_format")
        found.append(("response_format", StructuredOutputsParams(json=fmt.json_schema.json_schema)))
    so = req.structured_outputs
    if so is not None:
        try:
            found.append(("structured_outputs", StructuredOutputsParams(
                json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar, json_object=so.json_object,
                disable_any_whitespace=so.disable_any_whitespace)))
        except ValueError as e:
            raise bad_request(str(e), "structured_outputs") from None
    for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                       ("guided_grammar", "grammar")):
        value = getattr(req, name)
        if value is not None:
            try:
                found.append((name, StructuredOutputsParams(**{kind: value})))
            except ValueError as e:
                raise bad_request(str(e), name) from None
    if len(found) > 1:
        given = ", ".join(n for n, _ in found)
        raise bad_request(f"give at most one of {', '.join(STRUCTURED_OUTPUT_FIELDS)}; got {given}", found[1][0])
    if not found:
        return None, None
    name, params = found[0]
    check(params, name, backend)
    return params, name


def check(params: StructuredOutputsParams, param: str, backend: str) -> None:
    try:
        check_structured_outputs(params, backend)
    except ValueError as e:
        raise bad_request(str(e), param) from None


# ---- the tool plan ------------------------------------------------------------------------
@dataclass
class ToolPlan:
    mode: Literal["none", "auto", "required", "named"] = "none"
    tools: list[ChatTool] = field(default_factory=list)
    parser: ToolParser | None = None
    named: str | None = None
    constraint: StructuredOutputsParams | None = None


def plan_tools(tools: list[ChatTool], choice: ToolChoice | None, parallel: bool | None, parser_name: str | None,
               auto_enabled: bool, backend: str) -> ToolPlan:
    """What to do with a request's tools (a 400 where tool_choice cannot be met); `backend` checks the
    constraint of a required or named tool_choice."""
    if not tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return ToolPlan()
    parser = get_tool_parser(parser_name) if parser_name else None
    if choice is None or choice == "auto":
        if not (auto_enabled and parser is not None):
            raise bad_request('"auto" tool choice (the default with tools) needs the server started with '
                              "--enable-auto-tool-choice and --tool-call-parser; or set tool_choice to "
                              '"required", "none" or a named function', "tools")
        return ToolPlan("auto", tools, parser)
    if choice == "none":
        return ToolPlan("none", tools, parser)
    if choice == "required":
        schema = required_schema(tools, parallel is not False)
        plan = ToolPlan("required", tools, parser,
                        constraint=StructuredOutputsParams(json=schema, disable_any_whitespace=True))
    else:
        assert isinstance(choice, NamedToolChoice)
        tool = next((t for t in tools if t.function.name == choice.function.name), None)
        if tool is None:
            raise bad_request(f"tool_choice names the function {choice.function.name!r}, which is not in tools",
                              "tool_choice")
        plan = ToolPlan("named", tools, parser, named=tool.function.name,
                        constraint=StructuredOutputsParams(json=parameters_schema(tool), disable_any_whitespace=True))
    assert plan.constraint is not None
    check(plan.constraint, "tools", backend)
    return plan


def parameters_schema(tool: ChatTool) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


def required_schema(tools: list[ChatTool], parallel: bool) -> dict[str, Any]:
    """A JSON list of calls, [{"name": ..., "parameters": {...}}], each valid for its function."""
    one_of = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                                "parameters": parameters_schema(t)},
               "required": ["name", "parameters"]} for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": one_of}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


# ---- the conversation -----------------------------------------------------------------------
def template_takes_tools(template: str | None) -> bool:
    return template is not None and "tools" in template


def conversation(messages: list[ChatMessage], plan: ToolPlan | None,
                 takes_tools: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages as the chat template gets them, and the `tools` argument (None: not passed)."""
    call_format = plan.parser.call_format if plan is not None and plan.parser is not None else None
    conv: list[dict[str, Any]] = []
    for m in messages:
        role = "system" if m.role == "developer" else m.role
        entry: dict[str, Any] = {"role": role, "content": m.text()}
        if m.name is not None:
            entry["name"] = m.name
        if m.tool_calls:
            if takes_tools:
                entry["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                    "name": c.function.name, "arguments": _arguments_value(c.function.arguments)}}
                    for c in m.tool_calls]
            else:
                written = "\n".join(_written_call(c.function.name, c.function.arguments, call_format)
                                    for c in m.tool_calls)
                entry["content"] = (entry["content"] + "\n" + written).strip()
        if role == "tool":
            if takes_tools:
                if m.tool_call_id is not None:
                    entry["tool_call_id"] = m.tool_call_id
            else:
                entry = {"role": "user", "content": f"<tool_response>\n{m.text()}\n</tool_response>"}
        conv.append(entry)
    if plan is None or not plan.tools:
        return conv, None
    tools = [t.model_dump(exclude_none=True) for t in plan.tools]
    if takes_tools:
        return conv, tools
    prompt = tools_system_prompt(tools, call_format)
    if conv and conv[0]["role"] == "system":
        conv[0] = {**conv[0], "content": (conv[0]["content"] + "\n\n" + prompt).strip()}
    else:
        conv.insert(0, {"role": "system", "content": prompt})
    return conv, None


def tools_system_prompt(tools: list[dict[str, Any]], call_format: str | None) -> str:
    lines = ["You may call these functions (JSON schemas of their parameters):",
             *(json.dumps(t["function"], ensure_ascii=False) for t in tools)]
    if call_format:
        lines += ["To call a function, answer with:", call_format]
    return "\n".join(lines)


def _arguments_value(arguments: str) -> Any:
    """Templates index a call's arguments as a mapping: the JSON text decoded where it is an object."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments


def _written_call(name: str, arguments: str, call_format: str | None) -> str:
    body = json.dumps({"name": name, "arguments": _arguments_value(arguments)}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>" if call_format is None or "<tool_call>" in call_format else body


# ---- the answer -------------------------------------------------------------------------------
def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call(call: ParsedCall) -> ToolCall:
    return ToolCall(id=call_id(), function=FunctionCall(name=call.name, arguments=call.arguments))


def answer(plan: ToolPlan, text: str) -> tuple[str | None, list[ToolCall]]:
    """A whole answer's content and tool calls."""
    if plan.mode == "named":
        assert plan.named is not None
        return None, [tool_call(ParsedCall(plan.named, text))]
    if plan.mode == "required":
        calls = required_calls(text)
        return (text, []) if calls is None else (None, [tool_call(c) for c in calls])
    if plan.mode == "auto" and plan.parser is not None:
        found = plan.parser.extract(text)
        return found.content, [tool_call(c) for c in found.calls]
    return text, []


def required_calls(text: str) -> list[ParsedCall] | None:
    try:
        items = json.loads(text)
    except ValueError:
        return None  # cut short (max_tokens)
    if not isinstance(items, list):
        return None
    return [ParsedCall(i["name"], json.dumps(i.get("parameters", {}), ensure_ascii=False)) for i in items
            if isinstance(i, dict) and isinstance(i.get("name"), str)]


def finish_reason(plan: ToolPlan, reason: str | None, has_calls: bool) -> str | None:
    if has_calls and reason == "stop" and plan.mode in ("auto", "required"):
        return "tool_calls"
    return reason


class ToolCallStream:
    """One choice's streamed answer: feed() each new piece of text; it returns the content to send now
    and the tool_calls deltas (OpenAI's chunk shape: a call's id, type and name first, then arguments)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""
        self.sent = 0  # characters of text passed on as content
        self.calls = 0  # calls sent
        self.named_id: str | None = None

    @property
    def has_calls(self) -> bool:
        return self.calls > 0

    def feed(self, delta: str, final: bool) -> tuple[str | None, list[DeltaToolCall]]:
        self.text += delta
        mode = self.plan.mode
        if mode == "named":
            return None, self._named(delta)
        if mode == "required":
            return None, self._complete_calls(required_calls(self.text) or []) if final else []
        if mode != "auto" or self.plan.parser is None:
            return (delta or None), []
        return self._auto(final)

    def _named(self, delta: str) -> list[DeltaToolCall]:
        if self.named_id is None:
            self.named_id, self.calls = call_id(), 1
            return [DeltaToolCall(index=0, id=self.named_id, type="function",
                                  function=DeltaFunctionCall(name=self.plan.named, arguments=delta))]
        return [DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=delta))] if delta else []

    def _auto(self, final: bool) -> tuple[str | None, list[DeltaToolCall]]:
        parser = self.plan.parser
        assert parser is not None
        start = parser.call_start(self.text)
        if start < 0:
            end = len(self.text)
            if not final:
                end = self.sent if parser.at_start_only and parser.may_start(self.text) else end - _held(
                    self.text, parser)
            return self._content(end), []
        content = self._content(start)
        found = parser.extract(self.text)
        if final and not found.calls:  # what began like a call was not one: it is content after all
            return (content or "") + (self._content(len(self.text)) or "") or None, []
        return content, self._complete_calls(found.calls)

    def _content(self, end: int) -> str | None:
        if end <= self.sent:
            return None
        piece, self.sent = self.text[self.sent:end], end
        return piece

    def _complete_calls(self, calls: list[ParsedCall]) -> list[DeltaToolCall]:
        out = []
        for call in calls[self.calls:]:
            out.append(DeltaToolCall(index=self.calls, id=call_id(), type="function",
                                     function=DeltaFunctionCall(name=call.name, arguments=call.arguments)))
            self.calls += 1
        return out


def _held(text: str, parser: ToolParser) -> int:
    """How many characters at text's end could be the start of a call: held back until more text comes."""
    for k in range(min(len(parser.start) - 1, len(text)), 0, -1):
        if text.endswith(parser.start[:k]):
            return k
    return 0
