"""--structured-outputs-config (vLLM's StructuredOutputsConfig) and what only the guidance backend does:
the config's checks and its CLI flag, JSON whitespace bounded as xgrammar's, objects closed unless asked,
the server-wide disable_any_whitespace in both backends, and a request whose stop tokens are not the
engine's."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from tokenmill.config import EngineArgs
from tokenmill.core.request import Request
from tokenmill.engine.input_processor import load_tokenizer
from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams
from tokenmill.structured.backend import GrammarBackend
from tokenmill.structured.bitmask import allowed_ids
from tokenmill.structured.grammar import closed_objects, grammar_key
from tokenmill.structured.guidance import GuidanceBackend
from tokenmill.structured.registry import create_grammar_backend
from tokenmill.structured.xgrammar_backend import XGrammarBackend
from tokenmill.structured_outputs_config import StructuredOutputsConfig, resolve_structured_outputs_config

from ..fixtures import EOS, VOCAB


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: str) -> Any:
    return load_tokenizer(tokenizer_dir)


def encode(tokenizer: Any, text: str) -> list[int]:
    return [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]


def ready(b: GrammarBackend, rid: str, stops: tuple[int, ...] = (EOS,), **constraint: Any) -> Request:
    req = Request(rid, [5, 6], SamplingParams(structured_outputs=StructuredOutputsParams(**constraint)), stops)
    params = req.sampling_params.structured_outputs
    assert params is not None
    b.compile(grammar_key(params, b.disable_any_whitespace)).result(timeout=60)
    assert b.is_ready(req)
    return req


@pytest.mark.parametrize(("raw", "want"), [
    (None, StructuredOutputsConfig()),
    ({"backend": "auto"}, StructuredOutputsConfig("xgrammar")),
    ('{"backend": "guidance", "disable_any_whitespace": true}', StructuredOutputsConfig("guidance", True)),
    ({"backend": "guidance", "disable_additional_properties": False},
     StructuredOutputsConfig("guidance", False, False)),
    ({"disable_fallback": False, "reasoning_parser": ""}, StructuredOutputsConfig()),  # vLLM's, at their defaults
    ({"max_json_whitespace": 24}, StructuredOutputsConfig(max_json_whitespace=24)),
])
def test_the_config_as_vllm_spells_it(raw: Any, want: StructuredOutputsConfig) -> None:
    assert resolve_structured_outputs_config(raw) == want


@pytest.mark.parametrize(("raw", "says"), [
    ({"backend": "outlines"}, "vLLM's, not built into tokenmill"), ({"backend": "nope"}, "choose from"),
    ({"nope": 1}, "unknown field"), ("{bad", "not valid JSON"), ("[1]", "must be a JSON object"),
    ({"disable_any_whitespace": "yes"}, "true or false"), ({"reasoning_parser": "deepseek_r1"}, "not supported"),
    ({"max_json_whitespace": 0}, "integer >= 1 or null"), ({"max_json_whitespace": "8"}, "integer >= 1 or null"),
    ({"max_json_whitespace": True}, "integer >= 1 or null"),
])
def test_a_bad_config_is_one_value_error(raw: Any, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        resolve_structured_outputs_config(raw)


def test_the_cli_flag_reaches_the_engine_config(llama_dir: str) -> None:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    ns = parser.parse_args(["--structured-outputs-config", '{"backend": "guidance"}'])
    ns.model = llama_dir  # (each subcommand takes the model its own way)
    config = EngineArgs.from_cli_args(ns).create_engine_config()
    assert config.structured_outputs == StructuredOutputsConfig("guidance")


@pytest.mark.parametrize("bound", [None, 5])
def test_json_whitespace_is_any_run_unless_bounded_alike_in_both_backends(tokenizer: Any, bound: int | None) -> None:
    """vLLM's rule by default (any run of whitespace between two JSON tokens); max_json_whitespace bounds it."""
    [space] = encode(tokenizer, " ")
    [brace] = encode(tokenizer, "{")
    run = [brace] + [space] * 40
    for name in ("guidance", "xgrammar"):  # as the engine core makes them, from the server's config
        b = create_grammar_backend(StructuredOutputsConfig(name, max_json_whitespace=bound), lambda: tokenizer,
                                   VOCAB, (EOS,))
        ready(b, "a", json={"type": "object"})
        assert b.validate_tokens("a", run) == (len(run) if bound is None else 1 + bound), name
        b.shutdown()


@pytest.mark.parametrize("kind", ["xgrammar", "guidance"])
def test_the_servers_disable_any_whitespace_holds_for_every_request(tokenizer: Any, kind: str) -> None:
    [space] = encode(tokenizer, " ")
    [brace] = encode(tokenizer, "{")
    b: GrammarBackend = (
        GuidanceBackend(lambda: tokenizer, VOCAB, (EOS,), disable_any_whitespace=True) if kind == "guidance"
        else XGrammarBackend(lambda: tokenizer, VOCAB, disable_any_whitespace=True))
    ready(b, "a", json={"type": "object"})  # the request does not ask for it
    assert b.validate_tokens("a", [brace, space]) == 1
    b.shutdown()


def test_objects_take_only_their_schemas_properties_unless_asked(tokenizer: Any) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    text = encode(tokenizer, '{"a":1,"zz":2}')
    closed, open_ = (GuidanceBackend(lambda: tokenizer, VOCAB, (EOS,), disable_any_whitespace=True,
                                     disable_additional_properties=flag) for flag in (True, False))
    ready(closed, "a", json=schema)
    ready(open_, "a", json=schema)
    assert open_.validate_tokens("a", text) == len(text)
    assert closed.validate_tokens("a", text) < len(text)
    assert closed_objects({"type": "object", "properties": {"x": {"type": "object"}, "y": {
        "type": "object", "additionalProperties": True}}}) == {"type": "object", "additionalProperties": False,
        "properties": {"x": {"type": "object", "additionalProperties": False},
                       "y": {"type": "object", "additionalProperties": True}}}


def test_a_request_with_other_stop_tokens_than_the_engines(tokenizer: Any) -> None:
    b = GuidanceBackend(lambda: tokenizer, VOCAB, (EOS,))
    other = (EOS + 1, EOS + 2)
    req = ready(b, "a", stops=other, choice=["yes", "yes no"])
    assert not b.accept_tokens(req, encode(tokenizer, "yes"))  # it may end here, or go on
    mask = b.grammar_bitmask([req], {})
    allowed = set(allowed_ids((mask if isinstance(mask, dict) else mask.result(timeout=60))["a"][0]).tolist())
    assert allowed & {EOS, *other} == set(other)  # its own stop tokens, not the engine's
    assert b.accept_tokens(req, [other[1]])  # a stop token ends it
    b.shutdown()


@pytest.mark.parametrize(("schema", "says"), [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, 'Unimplemented keys: ["uniqueItems"]'),
    ({"type": "string", "pattern": "^(?=a)a+$"}, "look-around"),  # (xgrammar ignores the look-ahead)
])
def test_guidance_refuses_what_it_does_not_implement_in_one_line(schema: dict[str, Any], says: str) -> None:
    from tokenmill.structured.grammar import check_structured_outputs

    check_structured_outputs(StructuredOutputsParams(json=schema), "xgrammar")
    with pytest.raises(ValueError, match="invalid JSON schema") as error:
        check_structured_outputs(StructuredOutputsParams(json=schema), "guidance")
    assert says in str(error.value) and "\n" not in str(error.value)
