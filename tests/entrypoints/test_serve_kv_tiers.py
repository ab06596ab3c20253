"""The disk KV tier through `tokenmill serve`: a prefix evicted to disk by one server is found by the next
server on the same directory (the core process writes the queued blocks when it stops), the answer is
the one computed before, and /metrics counts the disk hits."""

from __future__ import annotations

import os
import re
from typing import Any

from tests.conftest import random_prompts
from tests.entrypoints.server import RemoteServer
from tokenmill.core.kv_disk_tier import SUFFIX

BLOCK = 8
PREFIXES = random_prompts(3, 40, 40, seed=21)
TAILS = random_prompts(3, 2, 7, seed=22)


def serve(model_dir: str, disk: str) -> RemoteServer:
    # 12 blocks of 8 tokens: the second and third prompts evict the first one's blocks
    return RemoteServer(model_dir, "--dtype", "float32", "--num-kv-blocks", "12", "--block-size", str(BLOCK),
                        "--max-model-len", "96", "--kv-offload-disk", disk, "--kv-offload-disk-size", "64MiB")


def complete(srv: RemoteServer, prompt: list[int]) -> str:
    with srv.client() as c:
        r = c.post("/v1/completions", json={"model": srv_model(srv), "prompt": prompt, "max_tokens": 6,
                                            "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


def srv_model(srv: RemoteServer) -> str:
    with srv.client() as c:
        return str(c.get("/v1/models").json()["data"][0]["id"])


def disk_metric(srv: RemoteServer, name: str, labels: str = "") -> float:
    with srv.client() as c:
        text = c.get("/metrics").text
    m = re.search(rf'^{name}\{{model_name="[^"]*",{labels}tier="disk"\}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def disk_hits(srv: RemoteServer) -> float:
    return disk_metric(srv, "tokenmill:kv_offload_hits_total")


def test_a_restarted_server_finds_its_prefixes_on_disk(llama_dir: str, tmp_path: Any) -> None:
    first = [p + t for p, t in zip(PREFIXES, TAILS, strict=True)]
    cold = serve(llama_dir, str(tmp_path))
    try:
        answers = [complete(cold, p) for p in first]
    finally:
        assert cold.stop() == 0
    warm = serve(llama_dir, str(tmp_path))
    try:
        assert disk_hits(warm) == 0
        assert complete(warm, first[0]) == answers[0]
        assert disk_hits(warm) >= 5 * BLOCK  # the 40-token prefix, 5 blocks, read from disk
        # the occupancy gauges: the blocks the first server left on disk, within the tier's size
        held = disk_metric(warm, "tokenmill:kv_offload_blocks", 'state="cached",')
        used = disk_metric(warm, "tokenmill:kv_offload_used_bytes")
        on_disk = [f for _, _, names in os.walk(tmp_path) for f in names if f.endswith(SUFFIX)]
        assert held == len(on_disk) >= 5
        assert 0 < used <= disk_metric(warm, "tokenmill:kv_offload_capacity_bytes") == 64 * 2**20
    finally:
        warm.stop()
