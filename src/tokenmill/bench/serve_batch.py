"""`tokenmill bench serve --batch-lines N`: a batch submitted through the server's Files and Batch API at
the start of the online load, so the online latencies show what the batch costs them, and the batch's
own figures: its completion time, and the output tokens it made while the online load ran (the
server's generation-token counter over that window, less the online requests' own tokens)."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

import httpx

from tokenmill.bench.serve_client import RequestOptions, request_body
from tokenmill.bench.serve_data import Chain

POLL_SECONDS = 0.5
GENERATION_TOKENS = "tokenmill:generation_tokens_total"


def batch_lines(chains: list[Chain], opts: RequestOptions) -> bytes:
    """The requests as a batch input file (the online requests' bodies, not streamed)."""
    lines = []
    for i, req in enumerate(r for c in chains for r in c):
        body = request_body(req, opts)
        body.pop("stream", None)
        body.pop("stream_options", None)
        lines.append(json.dumps({"custom_id": f"bench-{i}", "method": "POST", "url": opts.endpoint, "body": body}))
    return ("\n".join(lines) + "\n").encode()


async def generation_tokens(client: httpx.AsyncClient) -> float | None:
    """The server's output tokens so far (tokenmill's /metrics), None where it has no such counter."""
    try:
        resp = await client.get("/metrics")
    except httpx.HTTPError:
        return None
    for line in resp.text.splitlines():
        if line.startswith(GENERATION_TOKENS):
            return float(line.rsplit(" ", 1)[1])
    return None


@dataclass
class SubmittedBatch:
    batch_id: str
    submitted: float  # perf_counter
    tokens_at_start: float | None


async def submit(client: httpx.AsyncClient, content: bytes, endpoint: str) -> SubmittedBatch:
    tokens = await generation_tokens(client)
    start = time.perf_counter()
    resp = await client.post("/v1/files", files={"file": ("bench.jsonl", content)}, data={"purpose": "batch"})
    if resp.status_code != 200:
        raise ValueError(f"uploading the batch file failed: HTTP {resp.status_code}: {resp.text[:200]}")
    resp = await client.post("/v1/batches", json={"input_file_id": resp.json()["id"], "endpoint": endpoint,
                                                  "completion_window": "24h"})
    if resp.status_code != 200:
        raise ValueError(f"creating the batch failed: HTTP {resp.status_code}: {resp.text[:200]}")
    return SubmittedBatch(str(resp.json()["id"]), start, tokens)


async def finish(client: httpx.AsyncClient, batch: SubmittedBatch, online_end: float, online_tokens: int,
                 tokens_at_online_end: float | None) -> dict[str, Any]:
    """Waits for the batch to end; its figures, prefixed batch_."""
    at_online_end = (await client.get(f"/v1/batches/{batch.batch_id}")).json()
    while True:
        state = (await client.get(f"/v1/batches/{batch.batch_id}")).json()
        if state["status"] in ("completed", "failed", "expired", "cancelled"):
            break
        await asyncio.sleep(POLL_SECONDS)
    done = time.perf_counter()
    output_tokens = 0
    if state.get("output_file_id"):
        content = (await client.get(f"/v1/files/{state['output_file_id']}/content")).text
        for line in content.splitlines():
            usage = json.loads(line)["response"]["body"].get("usage") or {}
            output_tokens += int(usage.get("completion_tokens") or 0)
    online_window = max(online_end - batch.submitted, 1e-9)
    during = None
    if batch.tokens_at_start is not None and tokens_at_online_end is not None:
        during = max(tokens_at_online_end - batch.tokens_at_start - online_tokens, 0.0)
    counts = state["request_counts"]
    elapsed = done - batch.submitted
    return {
        "batch_id": batch.batch_id, "batch_status": state["status"], "batch_lines": counts["total"],
        "batch_completed": counts["completed"], "batch_failed": counts["failed"],
        "batch_completed_at_online_end": at_online_end["request_counts"]["completed"],
        "batch_completion_s": round(elapsed, 3), "batch_output_tokens": output_tokens,
        "batch_output_throughput": round(output_tokens / max(elapsed, 1e-9), 2),
        "batch_output_tokens_during_online": None if during is None else int(during),
        "batch_output_throughput_during_online": None if during is None else round(during / online_window, 2),
    }
