"""`tokenmill bench <kind>`: benchmark subcommands, each a module with add_args/run. Every kind takes
the same output options (results.add_output_args), checked before its run starts."""

from __future__ import annotations

import argparse
import functools
import importlib
from collections.abc import Callable
from typing import Any

from tokenmill.bench.results import ResultSink, add_output_args

KINDS = {
    "throughput": ("tokenmill.bench.throughput", "offline throughput over a workload"),
    "latency": ("tokenmill.bench.latency", "batch-1/batch-N prefill and decode latency vs the roofline"),
    "serve": ("tokenmill.bench.serve", "load generator against an OpenAI-compatible server"),
    "roofline": ("tokenmill.bench.roofline", "this machine's memory bandwidth and matmul GFLOP/s (cached)"),
    "embed": ("tokenmill.bench.embed", "embedding sentences/s against sentence-transformers' encode"),
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
        add_output_args(p)
        p.set_defaults(func=functools.partial(_checked_run, module.run))


def _checked_run(run: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    ResultSink.from_args(args).check()  # an unwritable output file fails now, not after the run
    return run(args)
