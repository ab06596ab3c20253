"""Prefix-aware routing against round-robin on a multi-tenant shared-prefix workload (issue #21's
router figure): for each policy, fresh replicas (`tokenmill serve`) behind a fresh `tokenmill router`,
the same requests from `tokenmill bench serve`, then the replicas' prefix-cache hit rate from their
/metrics. Tenants arrive in random order (seeded), each request is its tenant's system prompt plus
its own user part. Everything binds 127.0.0.1 and stops by itself.

    .venv/bin/python tools/router_bench.py --replicas 2 --num-prompts 160 --output tmp/router.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "tokenmill.entrypoints.cli", *args]


def wait_http(url: str, proc: subprocess.Popen[bytes], timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} not ready after {timeout}s")


def workload(path: Path, args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(10, 8000) for _ in range(args.prefix_len)] for _ in range(args.tenants)]
    with path.open("w") as f:
        for _ in range(args.num_prompts):
            ids = prefixes[rng.randrange(args.tenants)] + [rng.randrange(10, 8000) for _ in range(args.user_len)]
            f.write(json.dumps({"prompt_token_ids": ids, "max_tokens": args.output_len}) + "\n")


def prefix_counts(url: str) -> tuple[float, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text

    def total(name: str) -> float:
        return sum(float(v) for v in re.findall(rf"^tokenmill:{name}_total\{{[^}}]*\}} (\S+)$", text, re.M))

    return total("prefix_cache_hits"), total("prefix_cache_queries")


def run_policy(policy: str, data: Path, args: argparse.Namespace) -> dict[str, object]:
    procs: list[subprocess.Popen[bytes]] = []
    env = {**os.environ, "TOKENMILL_API_KEY": ""}
    try:
        urls = []
        for _ in range(args.replicas):
            port = free_port()
            procs.append(subprocess.Popen(cli("serve", args.model, "--port", str(port), "--kv-cache-memory",
                                              args.kv_cache_memory, "--num-threads", "1", "--served-model-name",
                                              "m"), env=env, stdout=subprocess.DEVNULL, start_new_session=True))
            urls.append(f"http://127.0.0.1:{port}")
        for url, proc in zip(urls, procs, strict=True):
            wait_http(f"{url}/health", proc)
        rport = free_port()
        workers = [a for u in urls for a in ("--worker", u)]
        procs.append(subprocess.Popen(cli("router", "--port", str(rport), "--policy", policy, *workers), env=env,
                                      stdout=subprocess.DEVNULL, start_new_session=True))
        router = f"http://127.0.0.1:{rport}"
        wait_http(f"{router}/health", procs[-1])
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            subprocess.run(cli("bench", "serve", "--base-url", router, "--model", "m", "--dataset", "jsonl",
                               "--dataset-path", str(data), "--request-rate", str(args.request_rate), "--seed",
                               str(args.seed), "--warmup", "0", "--no-progress", "--output-json", out.name),
                           check=True, env=env, stdout=subprocess.DEVNULL)
            result = json.loads(Path(out.name).read_text())
        hits = queries = 0.0
        for url in urls:
            h, q = prefix_counts(url)
            hits, queries = hits + h, queries + q
        return {"policy": policy, "prefix_hit_rate": hits / queries if queries else 0.0,
                "prefix_hit_tokens": hits, "prompt_tokens_looked_up": queries,
                "median_ttft_ms": result.get("median_ttft_ms"), "p99_ttft_ms": result.get("p99_ttft_ms"),
                "completed": result.get("completed"), "failed": result.get("failed"),
                "request_throughput": result.get("request_throughput")}
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(REPO / "models" / "tokenmill-demo"))
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--policies", default="prefix,round_robin")
    p.add_argument("--tenants", type=int, default=8, help="distinct system prompts")
    p.add_argument("--prefix-len", type=int, default=900, help="tokens of each system prompt")
    p.add_argument("--user-len", type=int, default=100, help="tokens each request adds after its system prompt")
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--num-prompts", type=int, default=160)
    p.add_argument("--request-rate", type=float, default=4.0)
    p.add_argument("--kv-cache-memory", default="10MiB",
                   help="per replica: too small for every tenant's prefix, enough for half of them")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None, help="write the JSON here too")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "tenants.jsonl"
        workload(data, args)
        runs = [run_policy(policy, data, args) for policy in args.policies.split(",")]
    record = {"bench": "router", "replicas": args.replicas, "tenants": args.tenants, "prefix_len": args.prefix_len,
              "user_len": args.user_len, "output_len": args.output_len, "num_prompts": args.num_prompts,
              "request_rate": args.request_rate, "kv_cache_memory": args.kv_cache_memory, "runs": runs}
    if len(runs) == 2 and runs[1]["prefix_hit_rate"] and runs[0]["median_ttft_ms"]:
        record["hit_rate_ratio"] = float(runs[0]["prefix_hit_rate"]) / float(runs[1]["prefix_hit_rate"])  # type: ignore[arg-type]
        record["median_ttft_ratio"] = float(runs[1]["median_ttft_ms"]) / float(runs[0]["median_ttft_ms"])  # type: ignore[arg-type]
    print(json.dumps(record, indent=2))
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
