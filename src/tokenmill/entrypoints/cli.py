"""`tokenmill` command line: subcommands are registered lazily by module path.

Each subcommand module defines `register(subparsers) -> None`, which adds its parser and sets
`func` (a callable taking the parsed namespace and returning an exit code).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

SUBCOMMANDS = [
    "tokenmill.entrypoints.cli_generate",
    "tokenmill.entrypoints.cli_serve",
    "tokenmill.entrypoints.cli_run_batch",
    "tokenmill.entrypoints.cli_quantize",
    "tokenmill.entrypoints.cli_router",
    "tokenmill.entrypoints.cli_disagg_proxy",
    "tokenmill.bench.cli",
    "tokenmill.bench.plan",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description="LLM inference and serving engine")
    parser.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    subparsers = parser.add_subparsers(dest="command", required=True)
    for path in SUBCOMMANDS:
        try:
            module = importlib.import_module(path)
        except ModuleNotFoundError as e:
            if e.name and path.startswith(e.name):
                continue  # not built yet
            raise
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except ValueError as e:
        print(f"tokenmill: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
