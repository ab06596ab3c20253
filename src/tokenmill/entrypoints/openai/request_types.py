"""The building blocks of the request schemas: bounded numbers (sampling_params' bounds, int64 where
OpenAI and vLLM set none), request ids, and the base model every request derives from, which
forbids unknown fields, rejects the OpenAI features tokenmill does not implement, and checks that
every string in a body is valid Unicode."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from tokenmill.sampling_params import INT64_MAX, INT64_MIN, MAX_PENALTY


def _integral(value: Any) -> Any:
    """JSON Schema's integers include 2.0: an integral float is read as the int it is (strict mode
    would reject it, and still rejects 2.5 and "2")."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


INTEGRAL = BeforeValidator(_integral)  # after the bounds in an Annotated, so the schema keeps them
# the schema markers below become the served model's own bounds in /openapi.json (openapi.py)
TOKEN_ID_MARK, TOKEN_COUNT_MARK = "x-token-id", "x-token-count"
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX), INTEGRAL]
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX, json_schema_extra={TOKEN_ID_MARK: True}), INTEGRAL]


def token_count(minimum: int) -> Any:
    """An int64 count of tokens: at most max_model_len - 1 in the served schema (a prompt has one)."""
    return Field(ge=minimum, le=INT64_MAX, json_schema_extra={TOKEN_COUNT_MARK: True})


NonEmptyStr = Annotated[str, Field(min_length=1)]
Penalty = Annotated[float, Field(ge=-MAX_PENALTY, le=MAX_PENALTY)]
# visible ASCII: it is echoed in the X-Request-Id header and used in the response id
REQUEST_ID_PATTERN = r"^[\x21-\x7e]{1,128}$"
RequestId = Annotated[str, Field(pattern=REQUEST_ID_PATTERN)]

# OpenAI fields tokenmill does not implement: accepted only with a value that asks for nothing.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "suffix": (None, ""), "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
    "function_call": (None, "none"), "response_format": (None, {"type": "text"}), "audio": (None,),
    "modalities": (None, ["text"]), "web_search_options": (None,), "best_of": (None, 1),
}

# OpenAI fields that do not apply to a local server (storage, billing tiers, caching hints,
# reasoning models, tools): accepted and ignored, with a warning the first time each is seen.
IGNORED_FIELDS = frozenset({
    "user", "metadata", "store", "service_tier", "reasoning_effort",
    "prompt_cache_key", "safety_identifier", "verbosity",
})


class OpenAIRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    checks_unicode: ClassVar[bool] = False  # set on the request bodies: nested models are checked with them

    @model_validator(mode="before")
    @classmethod
    def _reject_unsupported(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        if cls.checks_unicode:
            _check_unicode(data)
        for key in [k for k in data if k in _NEUTRAL and k not in cls.model_fields]:
            if data[key] not in _NEUTRAL[key]:
                raise PydanticCustomError("unsupported_field", "'{field}' is not supported by tokenmill",
                                          {"field": key})
            data = {k: v for k, v in data.items() if k != key}
        return data


def _check_unicode(data: Any) -> None:
    """Every string in a request body (keys too) must encode as UTF-8; JSON's "\\ud800" (a lone
    surrogate) parses into a str that does not, and would fail deep in the tokenizer."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if not value.isascii():
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError:
                    raise PydanticCustomError(
                        "invalid_unicode", "{field} is not valid Unicode: it holds a lone UTF-16 surrogate",
                        {"field": path or "body"}) from None
        elif isinstance(value, dict):
            for k, v in value.items():
                name = str(k).encode("utf-8", "backslashreplace").decode()  # the path goes into the error message
                stack.append((f"{path}.{name}" if path else name, k))
                stack.append((f"{path}.{name}" if path else name, v))
        elif isinstance(value, list) and not all(type(x) is int for x in value):
            stack.extend((f"{path}.{i}", v) for i, v in enumerate(value))


def requires(field: str, value: Any, then_field: str, then_value: Any) -> dict[str, Any]:
    """JSON Schema for: when `field` is `value`, `then_field` must be given as `then_value`."""
    return {"if": {"required": [field], "properties": {field: {"const": value}}},
            "then": {"required": [then_field], "properties": {then_field: {"const": then_value}}}}
