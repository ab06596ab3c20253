"""`bench serve --batch-lines`: the batch file it submits is the online requests' bodies, not streamed,
in the batch input format the server's batch runner reads."""

from __future__ import annotations

import json

from tokenmill.bench.serve_batch import batch_lines
from tokenmill.bench.serve_client import RequestOptions
from tokenmill.bench.serve_data import ServeRequest
from tokenmill.entrypoints.openai.batch_lines import parse_line


def test_batch_lines_are_the_online_requests_unstreamed() -> None:
    opts = RequestOptions("/v1/completions", "m", 0.0, True, {"seed": 3})
    chains = [[ServeRequest([5, 6, 7], 3, 4)], [ServeRequest("hi", 1, 2), ServeRequest("again", 1, 2)]]
    text = batch_lines(chains, opts).decode()
    seen: set[str] = set()
    parsed = [parse_line(t, "/v1/completions", seen) for t in text.splitlines()]
    assert [p.custom_id for p in parsed] == ["bench-0", "bench-1", "bench-2"] and all(p.error is None for p in parsed)
    bodies = [json.loads(p.body or "")["body"] for p in parsed]
    assert [b["prompt"] for b in bodies] == [[5, 6, 7], "hi", "again"]
    assert [b["max_tokens"] for b in bodies] == [4, 2, 2]
    assert all("stream" not in b and b["ignore_eos"] and b["seed"] == 3 for b in bodies)
