"""The server's /openapi.json tells the truth: schemathesis, with every check, generates requests
from it (valid and not) and finds nothing: the status codes sent are the ones documented (400, not
FastAPI's 422), in the error schema; 200s match their response models; /health and /metrics have
their content types; a 405 lists the allowed methods; every number the schema allows is accepted.

What JSON Schema cannot state is the one exception, on the three generating routes only: a request
the schema allows may still be a 400 there when prompt plus max_tokens does not fit max_model_len,
min_tokens is over max_tokens, prompts x n is over --max-prompts-per-request, a bad word is more
than one token, a logit_bias key is outside the vocabulary, or the chat template rejects the
messages. And an upload to /v1/files (multipart, a binary file) is a 400 when the file is not JSON Lines."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.entrypoints.server import RemoteServer

pytest.importorskip("schemathesis", reason="schemathesis is in the dev extra")

KEY = "sk-schema"
CONFIG = """
[[operations]]
include-path-regex = "^/v1/((chat/)?completions|responses)$"
checks.positive_data_acceptance.expected-statuses = [200, 400, 401, 404, 408, 413, 429, 503]

[[operations]]
include-name = "POST /v1/files"
checks.positive_data_acceptance.expected-statuses = [200, 400, 401, 413]
"""


@pytest.fixture(scope="module")
def server(llama_dir: str) -> Iterator[RemoteServer]:
    # small limits keep each generated request short: at most 4 sequences, 5 s each
    srv = RemoteServer(llama_dir, "--max-prompts-per-request", "4", "--request-timeout", "5", api_key=KEY)
    yield srv
    assert srv.stop() is not None


def test_schemathesis_finds_nothing(server: RemoteServer, tmp_path: Path) -> None:
    config = tmp_path / "schemathesis.toml"
    config.write_text(CONFIG)
    cmd = [sys.executable, "-m", "schemathesis.cli", "--no-color", "--config-file", str(config), "run",
           f"{server.url}/openapi.json", "--checks", "all", "-H", f"Authorization: Bearer {KEY}",
           "--max-examples", "10", "--max-time", "40", "--workers", "1", "--seed", "0",
           "--generation-database", "none", "--request-timeout", "30", "--output-sanitize", "false"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    summary = re.findall(r"^=+ (.*) =+$", out, re.MULTILINE)
    print("schemathesis:", summary[-1] if summary else out[-2000:])
    # warnings (a route whose ids no request can guess: /v1/responses/{id}) are not failures
    assert proc.returncode == 0 and summary and not re.search(r"failure|error", summary[-1]), out[-6000:]
    operations = re.search(r"Operations:\s+(\d+) selected / (\d+) total", out)
    assert operations and operations[1] == operations[2], out[:2000]  # every route was tested
