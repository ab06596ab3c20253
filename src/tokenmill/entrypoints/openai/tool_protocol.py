"""The request and response schemas of structured output and tool calling: OpenAI's `response_format`,
`tools`, `tool_choice` and tool calls, and vLLM's `structured_outputs` / `guided_*` extras."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tokenmill.entrypoints.openai.request_types import NonEmptyStr, OpenAIRequest


class JsonSchemaFormat(OpenAIRequest):
    model_config = ConfigDict(populate_by_name=True)
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIRequest):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(OpenAIRequest):
    """vLLM's `structured_outputs`: exactly one constraint."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: NonEmptyStr | None = None
    choice: list[NonEmptyStr] | None = None
    grammar: NonEmptyStr | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    model_config = ConfigDict(populate_by_name=True)


class FunctionDefinition(OpenAIRequest):
    name: NonEmptyStr
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(OpenAIRequest):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(OpenAIRequest):
    name: NonEmptyStr


class NamedToolChoice(OpenAIRequest):
    type: Literal["function"] = "function"
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ToolCallFunction(OpenAIRequest):
    name: str
    arguments: str


class ToolCallRequest(OpenAIRequest):
    """An assistant message's tool call in the history."""

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


# ---- responses ----------------------------------------------------------------------------
class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None
