"""`--structured-outputs-config`: vLLM's StructuredOutputsConfig JSON, checked once at start-up (torch-free).

`backend` picks the grammar library that builds the token bitmasks of requests with structured outputs
(structured/): xgrammar, or llguidance ("guidance"); "auto" is xgrammar. `disable_any_whitespace` makes
every JSON constraint compact (no whitespace between JSON tokens), as a request's own
`disable_any_whitespace` does for it. Otherwise any run of whitespace may separate two JSON tokens (vLLM's and
xgrammar's rule), unless `max_json_whitespace` (tokenmill's, not vLLM's) bounds it: at most that many
whitespace characters, with either backend, so that a model cannot emit whitespace until max_tokens; the
bound makes each bitmask several times dearer to fill. `disable_additional_properties` is guidance's: true, or left out,
makes its JSON objects take only the properties their schema names, as xgrammar's JSON grammars (built in
its strict mode) always do; false lets them take others where the schema does not forbid them (vLLM's
guidance default, which tokenmill does not follow: both backends give the same shape unless asked).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from tokenmill.json_arg import json_object

# each backend's library, which the API process loads to check requests' constraints
LIBRARY_MODULES = {"xgrammar": "xgrammar", "guidance": "llguidance"}
GRAMMAR_BACKENDS = tuple(LIBRARY_MODULES)
# vLLM's other backends, refused with the ones tokenmill has
_OTHER_BACKENDS = ("outlines", "lm-format-enforcer")
# vLLM's fields that take no effect here, accepted at their defaults for command lines written for vLLM
_INERT_DEFAULTS: dict[str, Any] = {"disable_fallback": False, "reasoning_parser": "", "reasoning_parser_plugin": "",
                                   "enable_in_reasoning": False}


@dataclass(frozen=True)
class StructuredOutputsConfig:
    backend: str = "xgrammar"  # resolved: one of GRAMMAR_BACKENDS
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = True
    max_json_whitespace: int | None = None  # None: any run


def resolve_structured_outputs_config(value: dict[str, Any] | str | None) -> StructuredOutputsConfig:
    """The config from a dict (Python) or its JSON (the CLI); a ValueError that says what to change."""
    if value is None:
        return StructuredOutputsConfig()
    raw = json_object(value, "structured_outputs_config")
    known = {f.name for f in fields(StructuredOutputsConfig)}
    unknown = sorted(set(raw) - known - set(_INERT_DEFAULTS))
    if unknown:
        raise ValueError(f"structured_outputs_config: unknown field(s) {unknown}; "
                         f"known: {sorted(known | set(_INERT_DEFAULTS))}")
    for name, default in _INERT_DEFAULTS.items():
        if name in raw and raw[name] not in (default, None):
            raise ValueError(f"structured_outputs_config: {name} is not supported by tokenmill (leave it out)")
    backend = raw.get("backend", "auto")
    if backend == "auto":
        backend = "xgrammar"
    if backend not in GRAMMAR_BACKENDS:
        extra = " (vLLM's, not built into tokenmill)" if backend in _OTHER_BACKENDS else ""
        raise ValueError(f"structured_outputs_config: backend {backend!r} unknown{extra}; choose from "
                         f"{['auto', *GRAMMAR_BACKENDS]}")
    flags = {f.name: raw.get(f.name, f.default) for f in fields(StructuredOutputsConfig)
             if f.name not in ("backend", "max_json_whitespace")}
    for name, flag in flags.items():
        if not isinstance(flag, bool):
            raise ValueError(f"structured_outputs_config: {name} must be true or false, got {flag!r}")
    bound = raw.get("max_json_whitespace")
    if bound is not None and (isinstance(bound, bool) or not isinstance(bound, int) or bound < 1):
        raise ValueError(f"structured_outputs_config: max_json_whitespace must be an integer >= 1 or null, "
                         f"got {bound!r}")
    return StructuredOutputsConfig(backend=backend, max_json_whitespace=bound, **flags)
