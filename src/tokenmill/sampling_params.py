"""Sampling parameters of one request, validated on construction.

The bounds below are the one definition of what a request may ask for: SamplingParams enforces
them (a ValueError naming the field) and the OpenAI server's request schemas declare them, so
/openapi.json documents them and an out-of-range value never reaches the engine (where an
integer past int64 overflows a tensor or the wire encoding)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, TypeVar

T = TypeVar("T")

_GREEDY_EPS = 1e-5

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
SEED_MAX = 2**64 - 1  # torch.Generator.manual_seed takes [INT64_MIN, SEED_MAX]; so does the wire
MAX_N = 128  # OpenAI's limit on choices per prompt
MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit (vLLM's default max_logprobs)
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-MAX_PENALTY, MAX_PENALTY]
MAX_LOGIT_BIAS = 100.0  # logit_bias values lie in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS], or are -inf (a ban)
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


class RequestOutputKind(Enum):
    CUMULATIVE = 0  # every RequestOutput carries everything so far
    DELTA = 1  # only what is new since the last RequestOutput
    FINAL_ONLY = 2  # one RequestOutput, when the request finishes


@dataclass
class StructuredOutputsParams:
    """vLLM's structured-output constraint: exactly one of a JSON schema (`json`, a dict or its JSON text),
    any JSON object (`json_object`), a regular expression, a list of choices, or an EBNF/GBNF grammar.
    Whether the schema, regex or grammar compiles is checked where the grammar backend lives (the engine's
    InputProcessor); here only the shape."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False  # JSON without free whitespace between tokens

    def __post_init__(self) -> None:
        given = [k for k in _CONSTRAINTS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs must set exactly one of json, json_object, regex, choice, grammar; "
                             f"got {', '.join(given) or 'none'}")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_outputs choice must be a non-empty list of non-empty strings")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs {name} must be a non-empty string")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError("structured_outputs json must be a JSON schema (an object or its JSON text)")

    @property
    def kind(self) -> str:
        return next(k for k in _CONSTRAINTS if getattr(self, k) not in (None, False))


_CONSTRAINTS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off; above the vocabulary: all of it
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # -inf bans a token
    # token sequences the output must not contain: each one's last token is banned where the output ends
    # with the rest of it (a one-token sequence is banned everywhere)
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    # a reference text's tokens (OpenAI's Predicted Outputs): speculative decoding drafts from it
    prediction_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None  # a grammar every output token must follow

    def __post_init__(self) -> None:
        self.stop = _coerce("stop", self.stop, lambda v: [v] if isinstance(v, str) else list(v or []))
        self.stop_token_ids = _coerce("stop_token_ids", self.stop_token_ids, lambda v: [int(t) for t in v or []])
        self.logit_bias = _coerce("logit_bias", self.logit_bias,
                                  lambda v: {int(k): float(x) for k, x in (v or {}).items()})
        self.bad_words_token_ids = _coerce("bad_words_token_ids", self.bad_words_token_ids,
                                           lambda v: [[int(t) for t in w] for w in v or []])
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as e:
                raise ValueError(f"structured_outputs has the wrong fields: {e}") from None
        if self.top_k == -1:
            self.top_k = 0
        self._validate()
        for name in _FLOAT_FIELDS:  # the sampler builds float tensors from these; an int past int64 overflows
            setattr(self, name, float(getattr(self, name)))
        if self.temperature < _GREEDY_EPS:
            self.temperature = 0.0

    def _validate(self) -> None:
        for ok, message in self._checks():
            if not ok:
                raise ValueError(message)

    def _checks(self) -> list[tuple[bool, str]]:
        last_child = self.n - 1 if _is_int(self.n) else 0  # child i of n draws from seed + i
        return [
            (_in(self.n, 1, MAX_N), f"n must be an integer in [1, {MAX_N}], got {self.n!r}"),
            (_finite(self.temperature) and self.temperature >= 0,
             f"temperature must be a finite number >= 0, got {self.temperature!r}"),
            (_finite(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}"),
            (_in(self.top_k, 0, INT64_MAX),
             f"top_k must be -1 (off) or an integer in [0, 2**63 - 1], got {self.top_k!r}"),
            (_finite(self.min_p) and 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p!r}"),
            (self.seed is None or _in(self.seed, INT64_MIN, SEED_MAX - last_child),
             f"seed must be an integer in [-2**63, 2**64 - n], got {self.seed!r}"),
            (self.max_tokens is None or _in(self.max_tokens, 1, INT64_MAX),
             f"max_tokens must be an integer in [1, 2**63 - 1], got {self.max_tokens!r}"),
            (_in(self.min_tokens, 0, INT64_MAX),
             f"min_tokens must be an integer in [0, 2**63 - 1], got {self.min_tokens!r}"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens,
             f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"),
            (all(isinstance(s, str) and s for s in self.stop), "stop must be a list of non-empty strings"),
            (all(_is_unicode(s) for s in self.stop), "stop strings must be valid Unicode (no lone surrogates)"),
            (all(0 <= t <= INT64_MAX for t in self.stop_token_ids),
             "stop_token_ids must be non-negative token ids"),
            (self.logprobs is None or _in(self.logprobs, 0, MAX_LOGPROBS),
             f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}"),
            (self.prompt_logprobs is None or _in(self.prompt_logprobs, 0, MAX_LOGPROBS),
             f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs!r}"),
            (_finite(self.presence_penalty) and -MAX_PENALTY <= self.presence_penalty <= MAX_PENALTY,
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty!r}"),
            (_finite(self.frequency_penalty) and -MAX_PENALTY <= self.frequency_penalty <= MAX_PENALTY,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty!r}"),
            (_finite(self.repetition_penalty) and self.repetition_penalty > 0,
             f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}"),
            (all(-MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS or v == -math.inf for v in self.logit_bias.values()),
             "logit_bias values must be in [-100, 100] (or -inf, which bans the token)"),
            (all(0 <= k <= INT64_MAX for k in self.logit_bias), "logit_bias keys must be non-negative token ids"),
            (all(w and all(0 <= t <= INT64_MAX for t in w) for w in self.bad_words_token_ids),
             "bad_words_token_ids must be non-empty lists of non-negative token ids"),
            (self.prediction_token_ids is None or all(_in(t, 0, INT64_MAX) for t in self.prediction_token_ids),
             "prediction_token_ids must be non-negative token ids"),
            (self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
             "structured_outputs must be a StructuredOutputsParams"),
        ]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def clone(self, **changes: object) -> SamplingParams:
        values = {f: getattr(self, f) for f in self.__dataclass_fields__}
        values.update(changes)
        return SamplingParams(**values)


def _coerce(name: str, value: Any, convert: Callable[[Any], T]) -> T:
    """Normalise a field; a value of the wrong type is a ValueError naming the field."""
    try:
        return convert(value)
    except (TypeError, ValueError, AttributeError, OverflowError):
        raise ValueError(f"{name} has the wrong type: {value!r}") from None


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _in(x: object, lo: int, hi: int) -> bool:
    """An integer (not a bool) in [lo, hi]."""
    return _is_int(x) and lo <= x <= hi  # type: ignore[operator]


def _finite(x: object) -> bool:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    try:
        return math.isfinite(float(x))
    except OverflowError:  # an int past float's range
        return False


def _is_unicode(s: object) -> bool:
    """Whether a str encodes as UTF-8: a lone surrogate (JSON's "\\ud800") does not."""
    if not isinstance(s, str) or s.isascii():
        return True
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
