"""Fault-injection run against `tokenmill serve` (the figures issue #27 asks for).

Usage (from the repository root)::

    .venv/bin/python tools/fault_run.py [MODEL] [--drops 1000]

Starts its own servers on 127.0.0.1 (free ports) and runs bounded loads, each with a time limit:
streams dropped mid-way (then the KV pool must be whole again: 0 leaked blocks), overload past
--max-queue-len (only 429s besides complete answers: 0 lost), a list of bad inputs (no 5xx, and the
server still serves), kill -9 of the engine core under load (every request ends with an error, the
server exits non-zero within seconds), and SIGTERM under load (a drain that finishes every request
and exits 0; a drain past --shutdown-timeout that ends the rest with an error and exits 3).
Prints one JSON summary and exits 1 if any expectation failed. Not a benchmark: it measures nothing
but counts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from typing import IO, Any

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STARTUP_TIMEOUT = 180.0
PHASE_TIMEOUT = 300.0
ENGINE_DEAD_EXIT_WITHIN = 10.0
LIMITS = ("--max-num-seqs", "8", "--max-queue-len", "8")  # the overload and bad-input servers'
CAPACITY = 16  # sequences those servers admit at once


class Server:
    """A `tokenmill serve` subprocess on 127.0.0.1, on a port the OS picks (--port 0)."""

    def __init__(self, model: str, *extra: str) -> None:
        args = [sys.executable, "-m", "tokenmill.entrypoints.cli", "serve", model, "--host", "127.0.0.1",
                "--port", "0", "--max-model-len", "1024", *extra]
        self.log: IO[str] = tempfile.TemporaryFile("w+")
        env = {**os.environ, "TOKENMILL_API_KEY": "", "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while (m := re.search(r"on (http://127\.0\.0\.1:\d+) \(engine core pid (\d+)", self.output())) is None:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not start:\n{self.output()}")
            time.sleep(0.2)
        self.url, self.core_pid = m.group(1), int(m.group(2))

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def wait(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            if self.wait(60) is None:
                os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: the server and its core
                self.proc.wait(10)
        return self.proc.returncode


def client(server: Server, connections: int = 64) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=server.url, timeout=120,
                             limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections))


async def metric(http: httpx.AsyncClient, name: str) -> float | None:
    text = (await http.get("/metrics")).text
    values = [float(x.split()[-1]) for x in text.splitlines() if x.startswith(f"tokenmill:{name}{{")]
    return values[0] if values else None


async def bounded(tasks: list[Any], concurrency: int) -> list[Any]:
    gate = asyncio.Semaphore(concurrency)

    async def run(work: Any) -> Any:
        async with gate:
            return await work

    return await asyncio.gather(*(run(t) for t in tasks))


async def request(http: httpx.AsyncClient, body: dict[str, Any]) -> str:
    """completed (every token asked for), error (a 503 error object, or an SSE error event then [DONE]),
    rejected (429), or what else happened."""
    try:
        if not body.get("stream"):
            r = await http.post("/v1/completions", json=body)
            if r.status_code == 200:
                done = r.json()["usage"]["completion_tokens"] == body["max_tokens"]
                return "completed" if done else "short"
            if r.status_code in (429, 503) and "error" in r.json():
                return "rejected" if r.status_code == 429 else "error"
            return f"http {r.status_code}"
        async with http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                if r.status_code in (429, 503) and "error" in r.json():
                    return "rejected" if r.status_code == 429 else "error"
                return f"http {r.status_code}"
            lines = [line async for line in r.aiter_lines() if line]
        if lines[-1:] != ["data: [DONE]"]:
            return "cut stream"
        last = json.loads(lines[-2][len("data: "):]) if len(lines) > 1 else {}
        if "error" in last:
            return "error"
        return "completed" if last.get("choices") and last["choices"][0].get("finish_reason") else "short"
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
        return f"{type(e).__name__}"


async def drop_streams(server: Server, count: int) -> dict[str, Any]:
    """Streams read for two events and then dropped; after them the whole KV pool is free again."""
    async with client(server, 16) as http:
        async def drop(i: int) -> bool:
            body = {"prompt": f"drop {i}", "max_tokens": 200, "ignore_eos": True, "stream": True}
            async with http.stream("POST", "/v1/completions", json=body) as r:
                events = 0
                async for line in r.aiter_lines():
                    events += bool(line)
                    if events == 2:
                        return True  # leaving the block closes the connection mid-stream
            return False

        dropped = sum(await bounded([drop(i) for i in range(count)], 16))
        deadline = time.monotonic() + 20
        while True:  # the core reports its pool with each step's outputs, aborts included
            total, free = await metric(http, "kv_cache_total_blocks"), await metric(http, "kv_cache_free_blocks")
            running = await metric(http, "num_requests_running")
            if (total is not None and free == total and running == 0) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
    leaked = None if total is None or free is None else int(total - free)
    return {"streams": count, "dropped_mid_way": dropped, "kv_blocks_total": total, "kv_blocks_free_after": free,
            "leaked_blocks": leaked, "ok": dropped == count and leaked == 0}


async def overload(server: Server, count: int = 200) -> dict[str, Any]:
    """More concurrent requests than --max-num-seqs + --max-queue-len: each completes or gets 429."""
    async with client(server) as http:
        bodies = [{"prompt": f"load {i}", "max_tokens": 32, "ignore_eos": True, "stream": i % 2 == 1}
                  for i in range(count)]
        outcomes = Counter(await bounded([request(http, b) for b in bodies], 48))
        after = await request(http, {"prompt": "after", "max_tokens": 4, "ignore_eos": True})
    lost = count - outcomes["completed"] - outcomes["rejected"]
    return {"requests": count, "completed": outcomes["completed"], "rejected_429": outcomes["rejected"],
            "lost": lost, "served_after": after == "completed",
            "ok": lost == 0 and outcomes["rejected"] > 0 and after == "completed"}


BAD_INPUTS: list[tuple[str, str, str | bytes]] = [  # (name, path, raw body)
    ("stop lone surrogate", "/v1/completions", '{"prompt": "x", "stop": ["\\ud800"]}'),
    ("stop string lone surrogate, streamed", "/v1/completions", '{"prompt": "x", "stop": "\\udfff", "stream": true}'),
    ("prompt lone surrogate", "/v1/completions", '{"prompt": "\\ud800"}'),
    ("chat content lone surrogate", "/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}'),
    ("tokenize lone surrogate", "/tokenize", '{"prompt": "\\ud800"}'),
    ("priority 2^64", "/v1/completions", '{"prompt": "x", "priority": 18446744073709551616}'),
    ("priority -2^63-1", "/v1/completions", '{"prompt": "x", "priority": -9223372036854775809}'),
    ("top_k 2^63", "/v1/completions", '{"prompt": "x", "top_k": 9223372036854775808}'),
    ("max_tokens 10^20", "/v1/completions", '{"prompt": "x", "max_tokens": 100000000000000000000}'),
    ("n 10^11", "/v1/completions", '{"prompt": "x", "n": 100000000000}'),
    ("logprobs 2^63", "/v1/completions", '{"prompt": "x", "logprobs": 9223372036854775808}'),
    ("min_tokens -1", "/v1/completions", '{"prompt": "x", "min_tokens": -1}'),
    ("logit_bias word key", "/v1/completions", '{"prompt": "x", "logit_bias": {"abc": 1}}'),
    ("logit_bias float key", "/v1/completions", '{"prompt": "x", "logit_bias": {"1.5": 1}}'),
    ("logit_bias 10^400 value", "/v1/completions", '{"prompt": "x", "logit_bias": {"5": 1e400}}'),
    ("temperature 1e309", "/v1/completions", '{"prompt": "x", "temperature": 1e309}'),
    ("temperature Infinity", "/v1/completions", '{"prompt": "x", "temperature": Infinity}'),
    ("top_p NaN", "/v1/completions", '{"prompt": "x", "top_p": NaN}'),
    ("stop_token_ids 2^64", "/v1/completions", '{"prompt": "x", "stop_token_ids": [18446744073709551616]}'),
    ("token id prompt 2^64", "/v1/completions", '{"prompt": [18446744073709551616]}'),
    ("2,000 prompts", "/v1/completions", json.dumps({"prompt": [[5, 6, 7]] * 2000, "max_tokens": 2})),
    ("nested 20,000 deep", "/v1/completions", '{"prompt": ' + "[" * 20000 + "]" * 20000 + "}"),
    ("not JSON", "/v1/completions", "{prompt: x"),
    ("invalid UTF-8", "/v1/completions", b'{"prompt": "\xff\xfe"}'),
]


async def bad_inputs(model: str) -> dict[str, Any]:
    """Each bad body gets a 4xx (none a 5xx, none a 2xx), and the server lives on; a case that ends the server is
    noted and the next one gets a fresh server. At the end the whole capacity still serves."""
    statuses: dict[str, str] = {}
    killed: list[str] = []
    server = Server(model, *LIMITS)
    try:
        for name, path, raw in BAD_INPUTS:
            async with client(server) as http:
                try:
                    r = await http.post(path, content=raw, headers={"content-type": "application/json"})
                    statuses[name] = str(r.status_code)
                except httpx.HTTPError as e:
                    statuses[name] = type(e).__name__
                alive = server.proc.poll() is None and await healthy(http)
            if not alive:
                killed.append(name)
                server.stop()
                server = Server(model, *LIMITS)
        async with client(server) as http:  # every admitted sequence given back: the capacity all fits
            after = Counter(await asyncio.gather(*(request(http, {"prompt": f"after {i}", "max_tokens": 4,
                                                                   "ignore_eos": True}) for i in range(CAPACITY))))
    finally:
        server.stop()
    five_xx = [n for n, s in statuses.items() if not s.isdigit() or s.startswith("5")]  # or no answer at all
    accepted = [n for n, s in statuses.items() if s.startswith("2")]
    return {"cases": len(BAD_INPUTS), "statuses": dict(Counter(statuses.values())), "count_5xx": len(five_xx),
            "5xx_cases": {n: statuses[n] for n in five_xx}, "accepted_cases": accepted,
            "cases_that_ended_the_server": killed, "full_capacity_served_after": after["completed"] == CAPACITY,
            "ok": not five_xx and not accepted and not killed and after["completed"] == CAPACITY}


async def healthy(http: httpx.AsyncClient) -> bool:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            return (await http.get("/health")).status_code == 200
        except httpx.HTTPError:
            await asyncio.sleep(0.2)
    return False


async def under_load(server: Server, count: int, max_tokens: int, fault: str) -> dict[str, Any]:
    """`count` requests (half streamed) in flight, then the fault: kill9 (the core), sigterm (the server)."""
    async with client(server) as http:
        bodies = [{"prompt": f"{fault} {i}", "max_tokens": max_tokens, "ignore_eos": True, "stream": i % 2 == 0}
                  for i in range(count)]
        tasks = [asyncio.ensure_future(request(http, b)) for b in bodies]
        deadline = time.monotonic() + 30
        while await metric(http, "http_requests_in_flight") != count and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        faulted = time.monotonic()
        late = None
        if fault == "kill9":
            os.kill(server.core_pid, signal.SIGKILL)
        else:
            server.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.2)
            late = await request(http, {"prompt": "late", "max_tokens": 2})
        outcomes = Counter(await asyncio.gather(*tasks))
    code = await asyncio.to_thread(server.wait, 90)
    summary: dict[str, Any] = {"requests": count, "outcomes": dict(outcomes), "exit_code": code,
                               "seconds_to_exit": round(time.monotonic() - faulted, 1)}
    if fault == "sigterm":
        summary["new_request_during_drain"] = late
    return summary


async def kill9(model: str) -> dict[str, Any]:
    server = Server(model)
    try:
        s = await under_load(server, 32, 400, "kill9")
    finally:
        server.stop()
    others = s["requests"] - s["outcomes"].get("completed", 0) - s["outcomes"].get("error", 0)
    s["ok"] = (others == 0 and s["outcomes"].get("error", 0) > 0 and s["exit_code"] not in (None, 0)
               and s["seconds_to_exit"] < ENGINE_DEAD_EXIT_WITHIN)
    return s


async def sigterm(model: str, shutdown_timeout: float, max_tokens: int) -> dict[str, Any]:
    server = Server(model, "--shutdown-timeout", str(shutdown_timeout))
    try:
        s = await under_load(server, 32, max_tokens, "sigterm")
    finally:
        server.stop()
    done, cut = s["outcomes"].get("completed", 0), s["outcomes"].get("error", 0)
    s["shutdown_timeout"] = shutdown_timeout
    s["ok"] = (done + cut == s["requests"] and s["exit_code"] == (3 if cut else 0)
               and s["new_request_during_drain"] == "error")
    return s


async def main(model: str, drops: int) -> dict[str, Any]:
    summary: dict[str, Any] = {"model": model}
    server = Server(model)
    try:
        summary["aborts"] = await asyncio.wait_for(drop_streams(server, drops), PHASE_TIMEOUT)
    finally:
        server.stop()
    server = Server(model, *LIMITS)
    try:
        summary["overload"] = await asyncio.wait_for(overload(server), PHASE_TIMEOUT)
    finally:
        server.stop()
    summary["bad_inputs"] = await asyncio.wait_for(bad_inputs(model), PHASE_TIMEOUT)
    summary["kill9_core_under_load"] = await asyncio.wait_for(kill9(model), PHASE_TIMEOUT)
    summary["sigterm_under_load_drained"] = await asyncio.wait_for(sigterm(model, 120, 64), PHASE_TIMEOUT)
    summary["sigterm_under_load_past_timeout"] = await asyncio.wait_for(sigterm(model, 1, 900), PHASE_TIMEOUT)
    summary["ok"] = all(v["ok"] for v in summary.values() if isinstance(v, dict))
    return summary


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=os.path.join(ROOT, "models", "tokenmill-demo"))
    parser.add_argument("--drops", type=int, default=1000, help="streams to drop mid-way (default 1000)")
    cli = parser.parse_args()
    result = asyncio.run(main(cli.model, cli.drops))
    print(json.dumps(result, indent=1))
    sys.exit(0 if result["ok"] else 1)
