"""`tokenmill bench latency --json-schema FILE`: every request constrained by the schema, the same number
of decode steps as without it, the grammar's compile time in the result; a schema that ends too soon
or cannot be read is one clear error."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tokenmill.entrypoints.cli import main

SCHEMA = Path(__file__).resolve().parents[2] / "bench" / "schemas" / "records.json"


def last_json(capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    return dict(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))


def test_latency_with_a_json_schema(llama_dir: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["bench", "latency", "--model", llama_dir, "--dtype", "float32", "--kv-cache-memory", "8MiB",
            "--num-threads", "1", "--input-len", "8", "--output-len", "6", "--runs", "1", "--batch-size", "4",
            "--no-roofline"]
    assert main([*base, "--json-schema", str(SCHEMA)]) == 0
    r = last_json(capsys)
    assert r["json_schema"] == "records.json" and r["grammar_compile_s"] > 0 and r["json_whitespace"] == "any"
    assert r["decode_ms_per_tok"] == pytest.approx(r["decode_s"] / 5 * 1e3, rel=1e-2)
    assert main([*base, "--json-schema", str(SCHEMA), "--structured-outputs-config", '{"max_json_whitespace": 8}']) == 0
    assert last_json(capsys)["json_whitespace"] == 8
    short = tmp_path / "short.json"
    short.write_text(json.dumps({"enum": ["a"]}))
    assert main([*base, "--json-schema", str(short)]) == 2
    assert "longer than --output-len" in capsys.readouterr().err
    short.write_text("{nope")
    assert main([*base, "--json-schema", str(short)]) == 2
    assert "cannot read a JSON schema" in capsys.readouterr().err
