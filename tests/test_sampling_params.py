"""SamplingParams bounds every number a request carries (int64 where OpenAI and vLLM set no
limit), so nothing past them reaches the engine, where it would overflow a tensor or the wire
encoding; the values at the bounds are accepted."""

from __future__ import annotations

import math
from typing import Any

import pytest

from tokenmill import SamplingParams
from tokenmill.sampling_params import INT64_MAX, INT64_MIN, SEED_MAX


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"top_k": INT64_MAX + 1}, "top_k"),
        ({"seed": SEED_MAX + 1}, "seed"),  # what torch's generator and the wire take
        ({"seed": SEED_MAX, "n": 2}, "seed"),  # the second sequence would draw from seed + 1
        ({"seed": INT64_MIN - 1}, "seed"),
        ({"n": 129}, "n"),
        ({"max_tokens": INT64_MAX + 1}, "max_tokens"),
        ({"min_tokens": INT64_MAX + 1, "max_tokens": None}, "min_tokens"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": 10**400}, "temperature"),
        ({"top_p": math.nan}, "top_p"),
        ({"min_p": math.inf}, "min_p"),
        ({"presence_penalty": math.inf}, "presence_penalty"),
        ({"repetition_penalty": math.inf}, "repetition_penalty"),
        ({"repetition_penalty": 10**400}, "repetition_penalty"),
        ({"logprobs": 21}, "logprobs"),
        ({"prompt_logprobs": 10**6}, "prompt_logprobs"),
        ({"stop_token_ids": [INT64_MAX + 1]}, "stop_token_ids"),
        ({"logit_bias": {INT64_MAX + 1: 1.0}}, "logit_bias"),
        ({"logit_bias": {5: math.inf}}, "logit_bias"),
        ({"logit_bias": {5: 10**400}}, "logit_bias"),
        ({"logit_bias": {"1" * 5000: 1.0}}, "logit_bias"),
        ({"stop": ["\ud800"]}, "stop"),
    ],
)
def test_out_of_range_is_a_value_error_naming_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        SamplingParams(**kwargs)


def test_the_bounds_themselves_are_accepted() -> None:
    p = SamplingParams(top_k=INT64_MAX, seed=INT64_MAX, n=128, max_tokens=INT64_MAX, min_tokens=INT64_MAX,
                       logprobs=20, prompt_logprobs=20, temperature=2, repetition_penalty=1e300,
                       logit_bias={5: -math.inf, 6: 100.0}, stop=["\U0001f600"])
    assert p.top_k == INT64_MAX and p.seed == INT64_MAX and p.logit_bias[5] == -math.inf
    assert SamplingParams(seed=INT64_MIN).seed == INT64_MIN
    assert SamplingParams(seed=INT64_MAX, n=128).seed == INT64_MAX  # the OpenAI server's largest, with n children


def test_float_fields_are_floats() -> None:
    """The sampler builds float tensors from these; an int would make torch infer an int64 tensor."""
    p = SamplingParams(temperature=2, top_p=1, min_p=0, presence_penalty=1, frequency_penalty=-1,
                       repetition_penalty=2)
    values = [p.temperature, p.top_p, p.min_p, p.presence_penalty, p.frequency_penalty, p.repetition_penalty]
    assert all(type(v) is float for v in values)
