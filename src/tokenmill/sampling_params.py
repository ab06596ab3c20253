"""Sampling parameters of one request, validated on construction."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, TypeVar

T = TypeVar("T")

_GREEDY_EPS = 1e-5


class RequestOutputKind(Enum):
    CUMULATIVE = 0  # every RequestOutput carries everything so far
    DELTA = 1  # only what is new since the last RequestOutput
    FINAL_ONLY = 2  # one RequestOutput, when the request finishes


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
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
    logit_bias: dict[int, float] = field(default_factory=dict)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        self.stop = _coerce("stop", self.stop, lambda v: [v] if isinstance(v, str) else list(v or []))
        self.stop_token_ids = _coerce("stop_token_ids", self.stop_token_ids, lambda v: [int(t) for t in v or []])
        self.logit_bias = _coerce("logit_bias", self.logit_bias,
                                  lambda v: {int(k): float(x) for k, x in (v or {}).items()})
        if self.top_k == -1:
            self.top_k = 0
        self._validate()
        if self.temperature < _GREEDY_EPS:
            self.temperature = 0.0

    def _validate(self) -> None:
        checks: list[tuple[bool, str]] = [
            (_is_int(self.n) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}"),
            (_is_num(self.temperature) and self.temperature >= 0,
             f"temperature must be >= 0, got {self.temperature!r}"),
            (_is_num(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}"),
            (_is_int(self.top_k) and self.top_k >= 0,
             f"top_k must be -1 (off) or a positive integer, got {self.top_k!r}"),
            (_is_num(self.min_p) and 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p!r}"),
            (self.seed is None or _is_int(self.seed), f"seed must be an integer, got {self.seed!r}"),
            (self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
             f"max_tokens must be at least 1, got {self.max_tokens!r}"),
            (_is_int(self.min_tokens) and self.min_tokens >= 0,
             f"min_tokens must be >= 0, got {self.min_tokens!r}"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens,
             f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"),
            (all(isinstance(s, str) and s for s in self.stop), "stop must be a list of non-empty strings"),
            (all(t >= 0 for t in self.stop_token_ids), "stop_token_ids must be non-negative"),
            (self.logprobs is None or (_is_int(self.logprobs) and self.logprobs >= 0),
             f"logprobs must be a non-negative integer, got {self.logprobs!r}"),
            (self.prompt_logprobs is None or (_is_int(self.prompt_logprobs) and self.prompt_logprobs >= 0),
             f"prompt_logprobs must be a non-negative integer, got {self.prompt_logprobs!r}"),
            (_is_num(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty!r}"),
            (_is_num(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty!r}"),
            (_is_num(self.repetition_penalty) and self.repetition_penalty > 0,
             f"repetition_penalty must be > 0, got {self.repetition_penalty!r}"),
            (all(-100 <= v <= 100 for v in self.logit_bias.values()),
             "logit_bias values must be in [-100, 100]"),
            (all(k >= 0 for k in self.logit_bias), "logit_bias keys must be non-negative token ids"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

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
    except (TypeError, ValueError, AttributeError):
        raise ValueError(f"{name} has the wrong type: {value!r}") from None


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)
