"""Valid by construction, with each grammar backend: the demo model, 200 seeded requests over 10 JSON
schemas (nested objects, arrays, enums, numbers with bounds, required fields) in one batch; every output is
complete (the grammar's end ends it, finish_reason "stop") and parses and validates with jsonschema."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.sampling_params import StructuredOutputsParams

DEMO = Path(__file__).resolve().parents[2] / "models" / "tokenmill-demo"
NAME = {"type": "string", "minLength": 1, "maxLength": 6}
SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
     "required": ["color", "ok"]},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": -1, "maximum": 1},
                                      "count": {"type": "integer", "minimum": 10, "maximum": 99}},
     "required": ["score", "count"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                               "minItems": 1, "maxItems": 4}}, "required": ["tags"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 9999}, "role": {"enum": ["admin", "guest"]}},
        "required": ["id", "role"]}}, "required": ["user"]},
    {"type": "array", "items": {"type": "integer", "minimum": -50, "maximum": 50}, "minItems": 2, "maxItems": 5},
    {"type": "object", "properties": {"point": {"type": "array", "items": {"type": "number", "minimum": 0,
                                                                          "maximum": 10},
                                                "minItems": 2, "maxItems": 2}, "label": NAME},
     "required": ["point"]},
    {"type": "object", "properties": {"kind": {"const": "event"}, "day": {"type": "integer", "minimum": 1,
                                                                          "maximum": 31},
                                      "month": {"enum": ["jan", "feb", "mar"]}}, "required": ["kind", "day", "month"]},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"sku": NAME, "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["sku", "qty"]}}, "total": {"type": "integer", "minimum": 0, "maximum": 999}},
     "required": ["items", "total"]},
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "confidence": {
        "type": "number", "minimum": 0, "maximum": 1}, "note": {"anyOf": [NAME, {"type": "null"}]}},
     "required": ["answer", "confidence", "note"]},
]
PER_SCHEMA = 20


@pytest.mark.skipif(not DEMO.is_dir(), reason="the demo model ships with the repository")
@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_200_seeded_requests_over_10_schemas_all_validate(backend: str) -> None:
    llm = LLM(str(DEMO), max_num_seqs=256, structured_outputs_config={"backend": backend})
    prompts, params = [], []
    for i in range(len(SCHEMAS) * PER_SCHEMA):
        schema = SCHEMAS[i % len(SCHEMAS)]
        prompts.append(["ROMEO:", "JULIET:", "First Citizen:", "KING HENRY:"][i % 4])
        params.append(SamplingParams(temperature=1.0, seed=1000 + i, max_tokens=128, structured_outputs=(
            StructuredOutputsParams(json=schema, disable_any_whitespace=True))))
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert len(outputs) == 200
    for i, out in enumerate(outputs):
        comp = out.outputs[0]
        assert comp.finish_reason == "stop", (i, comp.text)
        jsonschema.validate(json.loads(comp.text), SCHEMAS[i % len(SCHEMAS)])
