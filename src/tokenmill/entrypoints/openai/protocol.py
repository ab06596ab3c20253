"""OpenAI API schemas (pydantic). Requests are strict and forbid unknown fields, so a typo or an
unsupported feature is a 400 that names the field, never silently ignored. Every number is bounded
(sampling_params' bounds, int64 where OpenAI and vLLM set none) and every string must be valid
Unicode, so a request the schema accepts cannot overflow or crash anything behind it."""

from __future__ import annotations

import time
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator
from pydantic.json_schema import SkipJsonSchema
from pydantic_core import PydanticCustomError

from tokenmill.entrypoints.openai.request_types import (
    INTEGRAL,
    Int64,
    NonEmptyStr,
    OpenAIRequest,
    Penalty,
    RequestId,
    TokenId,
    requires,
    token_count,
)
from tokenmill.entrypoints.openai.tool_protocol import (
    ChatTool,
    DeltaToolCall,
    ResponseFormat,
    StructuredOutputsRequest,
    ToolCall,
    ToolCallRequest,
    ToolChoice,
)
from tokenmill.sampling_params import INT64_MAX, MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_N


class StreamOptions(OpenAIRequest):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False
    include_obfuscation: bool | None = None  # OpenAI's padding against length side channels: not sent


class SamplingRequest(OpenAIRequest):
    """Fields completions and chat share, including vLLM's extras."""

    checks_unicode: ClassVar[bool] = True
    model: str | None = None
    max_tokens: Annotated[int, token_count(1), INTEGRAL] | None = None
    temperature: Annotated[float, Field(ge=0)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N), INTEGRAL] = 1
    # vLLM's: the top k logprobs of every prompt token after the first (`prompt_logprobs` in the answer)
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS), INTEGRAL] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: NonEmptyStr | list[NonEmptyStr] | None = None
    seed: Int64 | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]] | None = None
    user: str | None = None
    top_k: Annotated[int, Field(ge=-1, le=INT64_MAX), INTEGRAL] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    min_tokens: Annotated[int, token_count(0), INTEGRAL] = 0
    repetition_penalty: Annotated[float, Field(gt=0)] | None = None
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: Int64 = 0
    request_id: RequestId | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=1, le=INT64_MAX), INTEGRAL] | None = None
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1)] | None = None
    bad_words: list[NonEmptyStr] | None = None
    # structured output (at most one of these): OpenAI's, and vLLM's extras
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: NonEmptyStr | None = None
    guided_choice: list[NonEmptyStr] | None = None
    guided_grammar: NonEmptyStr | None = None
    guided_decoding_backend: str | None = None  # xgrammar is the one backend: accepted, ignored
    guided_whitespace_pattern: str | None = None  # accepted, ignored
    # vLLM's disaggregated prefill/decode: {"do_remote_decode": true} asks a KV producer to compute the prompt
    # and keep its blocks; {"do_remote_prefill": true, "remote_host", "remote_port", "remote_request_id"}
    # (a producer's answer) asks a KV consumer to pull them and decode (serving_engine.kv_transfer_params)
    kv_transfer_params: dict[str, Any] | None = None


class CompletionRequest(SamplingRequest):
    model_config = ConfigDict(json_schema_extra={"allOf": [requires("max_tokens", 0, "echo", True)]})
    prompt: (NonEmptyStr | Annotated[list[NonEmptyStr], Field(min_length=1)]
             | Annotated[list[TokenId], Field(min_length=1)]
             | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)])
    max_tokens: Annotated[int, token_count(0), INTEGRAL] | None = 16  # 0 only with echo: scoring a prompt
    echo: bool | None = False
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS), INTEGRAL] | None = None
    add_special_tokens: bool = True
    # vLLM's beam search extras: n beams, the best n returned, ranked by cum_logprob / len ** length_penalty
    use_beam_search: bool = False
    length_penalty: Annotated[float, Field(ge=-10, le=10)] = 1.0


class TextPart(OpenAIRequest):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIRequest):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallRequest] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message's answer to that call

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)


class PredictionContent(OpenAIRequest):
    """OpenAI's Predicted Outputs: the reference text speculative decoding drafts from (spec_decode/adaptive.py)."""

    type: Literal["content"]
    content: str | list[TextPart]


class ChatCompletionRequest(SamplingRequest):
    model_config = ConfigDict(json_schema_extra={"allOf": [
        {"if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer"}}},
         "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}},
        requires("continue_final_message", True, "add_generation_prompt", False)]})
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Annotated[int, token_count(1), INTEGRAL] | None = None
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS), INTEGRAL] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None
    # IGNORED_FIELDS that only chat has
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    reasoning_effort: str | None = None
    parallel_tool_calls: bool | None = None
    prediction: PredictionContent | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    verbosity: str | None = None


class TokenizeRequest(OpenAIRequest):
    """Exactly one of prompt (text) or messages (through the chat template)."""

    model_config = ConfigDict(json_schema_extra={"oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}]})
    checks_unicode: ClassVar[bool] = True
    model: str | None = None
    prompt: str | SkipJsonSchema[None] = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | SkipJsonSchema[None] = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="before")
    @classmethod
    def _one_input(cls, data: Any) -> Any:
        if isinstance(data, dict):
            given = [k for k in ("prompt", "messages") if k in data]
            if len(given) != 1 or data[given[0]] is None:
                raise PydanticCustomError("one_input", "give exactly one of 'prompt' or 'messages'")
        return data


class DetokenizeRequest(OpenAIRequest):
    checks_unicode: ClassVar[bool] = True
    model: str | None = None
    tokens: list[TokenId]


# ---- responses ----------------------------------------------------------------------------
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class CompletionTokensDetails(BaseModel):
    """OpenAI's Predicted Outputs figures: the prediction's tokens that appear in the completion (in
    order, as difflib matches them) and those that do not."""

    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    completion_tokens_details: CompletionTokensDetails | None = None


class CompletionLogProbs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    # vLLM's shape: per prompt position, None for the first, else {token id: its logprob} for the actual
    # token and the top `prompt_logprobs` ones
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None  # vLLM's, as on completions


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="plain")
    def _drop_none(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: v for k, v in (("role", self.role), ("content", self.content)) if v is not None}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump(exclude_none=True) for c in self.tool_calls]
        return out


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "tokenmill"
    root: str | None = None
    max_model_len: int | None = None


class VersionResponse(BaseModel):
    version: str


class ResetPrefixCacheResponse(BaseModel):
    reset: bool


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str
