"""From a request's StructuredOutputsParams to the key its compiled grammar is cached under, and from a key
to the grammar (tokenizer-independent) of each backend: an xgrammar Grammar, or llguidance's grammar text
(guidance_grammar, for structured/guidance.py). Building the grammar is the check that a schema, regex or
EBNF grammar is valid: the engine's InputProcessor calls check_structured_outputs, with the engine's
backend, before a request reaches the core, so a bad one is a ValueError (an HTTP 400) that names the
constraint."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tokenmill.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar as xgr

_WHITESPACE = r"[\x20\x0A\x0D\x09]"  # JSON's whitespace characters, as a regex class (guidance's option)
GrammarKey = tuple[str, str, bool]  # (kind, the constraint's canonical text, free whitespace in JSON)


def grammar_key(params: StructuredOutputsParams, disable_any_whitespace: bool = False) -> GrammarKey:
    """disable_any_whitespace: the server's (--structured-outputs-config), over every request's own."""
    kind = params.kind
    value: Any = getattr(params, kind)
    if kind == "json":
        value = _schema_text(value)
    elif kind == "choice":
        value = json.dumps(value)
    elif kind == "json_object":
        value = ""
    return kind, str(value), not (params.disable_any_whitespace or disable_any_whitespace)


def build_grammar(key: GrammarKey, max_whitespace: int | None = None) -> xgr.Grammar:
    """The grammar for a key; a ValueError that says what is wrong when it cannot be built. max_whitespace: the
    most whitespace characters between two JSON tokens where any whitespace is (None: any run)."""
    import xgrammar as xgr

    kind, text, any_whitespace = key
    try:
        if kind in ("json", "json_object"):  # json_object: any JSON object (OpenAI's JSON mode)
            return xgr.Grammar.from_json_schema(
                text if kind == "json" else '{"type": "object"}', any_whitespace=any_whitespace,
                strict_mode=kind == "json", max_whitespace_cnt=max_whitespace if any_whitespace else None)
        if kind == "regex":
            return xgr.Grammar.from_regex(text)
        if kind == "choice":
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(_ebnf_literal(c) for c in json.loads(text)))
        return xgr.Grammar.from_ebnf(text)
    except (RuntimeError, ValueError, TypeError) as e:
        raise invalid(kind, _first_line(e)) from None


def guidance_grammar(key: GrammarKey, disable_additional_properties: bool = True,
                     max_whitespace: int | None = None) -> str:
    """llguidance's grammar text for a key; a ValueError that says what is wrong when it is not valid.
    max_whitespace: build_grammar's."""
    import llguidance as llg

    kind, text, any_whitespace = key
    try:
        if kind in ("json", "json_object"):
            schema: Any = json.loads(text) if kind == "json" else {"type": "object"}
            if disable_additional_properties:
                schema = closed_objects(schema)
            options: dict[str, Any] = {"whitespace_flexible": any_whitespace}
            if any_whitespace and max_whitespace is not None:  # (llguidance's own pattern: any run)
                options["whitespace_pattern"] = f"{_WHITESPACE}{{1,{max_whitespace}}}"
            grammar = llg.LLMatcher.grammar_from_json_schema(schema, overrides=options)  # type: ignore[arg-type]
        elif kind == "regex":
            grammar = llg.LLMatcher.grammar_from_regex(text)
        elif kind == "choice":
            grammar = llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in json.loads(text)))
        else:
            grammar = llg.grammar_from("grammar", text)
    except ValueError as e:
        raise invalid(kind, guidance_message(str(e))) from None
    error = llg.LLMatcher.validate_grammar(grammar)
    if error:
        raise invalid(kind, guidance_message(error))
    return grammar


def guidance_message(text: str) -> str:
    """llguidance's error in one line: its first line, and the line that says what is wrong where the first
    only says where (a regex error prints the pattern and a caret line between them)."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if not lines:
        return "rejected by llguidance"
    detail = next((line for line in lines[1:] if line.startswith("error:")), None)
    return lines[0] if detail is None else f"{lines[0]} {detail}"


def closed_objects(schema: Any) -> Any:
    """The schema with `"additionalProperties": false` in every object schema that does not say otherwise."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed_objects(v) for k, v in schema.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def check_structured_outputs(params: StructuredOutputsParams, backend: str = "xgrammar") -> None:
    """Raise ValueError when the constraint cannot be turned into the backend's grammar."""
    _check_key(grammar_key(params), backend)


@functools.lru_cache(maxsize=256)  # a pure function of the key: each distinct constraint is built once
def _check_key(key: GrammarKey, backend: str) -> None:
    if key[0] == "json":
        try:
            schema = json.loads(key[1])
        except ValueError:
            raise ValueError("structured output: the JSON schema is not valid JSON") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError("structured output: a JSON schema must be an object")
    _BUILDERS[backend](key)


# each backend's grammar from a key (structured_outputs_config.GRAMMAR_BACKENDS)
_BUILDERS: dict[str, Callable[[GrammarKey], Any]] = {"xgrammar": build_grammar, "guidance": guidance_grammar}


def _schema_text(schema: str | dict[str, Any]) -> str:
    if isinstance(schema, str):
        try:
            return json.dumps(json.loads(schema), separators=(",", ":"))
        except ValueError:
            return schema  # check_structured_outputs reports it
    return json.dumps(schema, separators=(",", ":"))


def _ebnf_literal(text: str) -> str:
    """A double-quoted EBNF string matching text exactly."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch.isprintable() and ch.isascii():
            out.append(ch)
        else:
            out.append(f"\\U{ord(ch):08x}" if ord(ch) > 0xFFFF else f"\\u{ord(ch):04x}")
    return '"' + "".join(out) + '"'


def invalid(kind: str, message: str) -> ValueError:
    """The error of a constraint that is not valid, naming its kind."""
    what = {"json": "JSON schema", "regex": "regex", "grammar": "grammar"}.get(kind, kind)
    return ValueError(f"structured output: invalid {what}: {message}")


def _first_line(error: Exception) -> str:
    """xgrammar's messages start with a timestamp and a source location: keep what follows them."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    head, sep, rest = text.partition(": ")
    return rest if sep and (".cc:" in head or head.startswith("[")) else text
