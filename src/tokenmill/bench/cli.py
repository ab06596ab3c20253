"""`tokenmill bench <kind>`: benchmark subcommands, each a module with add_args/run."""

from __future__ import annotations

import importlib
from typing import Any

KINDS = {
    "throughput": ("tokenmill.bench.throughput", "offline throughput over a workload"),
    "latency": ("tokenmill.bench.latency", "batch-1/batch-N prefill and decode latency vs the roofline"),
    "serve": ("tokenmill.bench.serve", "load generator against an OpenAI-compatible server"),
    "roofline": ("tokenmill.bench.roofline", "this machine's memory bandwidth and matmul GFLOP/s (cached)"),
}


def register(subparsers: Any) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks that write JSON results")
    kinds = bench.add_subparsers(dest="bench_kind", required=True)
    for name, (path, help_text) in KINDS.items():
        try:
            module = importlib.import_module(path)
        except ModuleNotFoundError as e:
            if e.name == path:
                continue  # not built yet
            raise
        p = kinds.add_parser(name, help=help_text)
        module.add_args(p)
        p.set_defaults(func=module.run)
