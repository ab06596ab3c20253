"""Cold start of `tokenmill serve`: seconds from launching the command to the first streamed token.

Usage (from the repository root)::

    .venv/bin/python tools/cold_start.py [--model models/tokenmill-demo] [--runs 5] [--port 8300]

Each run launches `.venv/bin/tokenmill serve MODEL` in its own session, sends a streamed completion
(polling until the server answers), takes the time of the first event that carries text, then stops
the server with SIGTERM. Prints each run and the median.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import time
import urllib.request


def first_token_seconds(model: str, port: int, limit_s: float = 60.0) -> float:
    start = time.perf_counter()
    proc = subprocess.Popen([".venv/bin/tokenmill", "serve", model, "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    body = json.dumps({"model": model, "prompt": "To be", "max_tokens": 4, "stream": True}).encode()
    try:
        while time.perf_counter() - start < limit_s:
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=30) as r:
                    for line in r:
                        if line.startswith(b"data: {") and b'"text"' in line:
                            return time.perf_counter() - start
            except OSError:  # not listening yet
                time.sleep(0.02)
        raise RuntimeError(f"no token within {limit_s} s")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=os.path.join("models", "tokenmill-demo"))
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--port", type=int, default=8300, help="first port; run i uses port + i")
    args = p.parse_args()
    runs = []
    for i in range(args.runs):
        runs.append(first_token_seconds(args.model, args.port + i))
        time.sleep(1)  # let the previous server's ports and memory go
    print("runs (s):", ", ".join(f"{s:.2f}" for s in runs), f"median {statistics.median(runs):.2f}")


if __name__ == "__main__":
    main()
