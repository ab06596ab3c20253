"""`tokenmill serve --help` documents every engine option, from EngineArgs' own field help, and
the options parse back into the EngineArgs they stand for."""

from __future__ import annotations

import argparse
from dataclasses import fields

from tokenmill.config import EngineArgs
from tokenmill.entrypoints.cli import build_parser


def serve_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parser = sub.choices["serve"]
    assert isinstance(parser, argparse.ArgumentParser)
    return parser


def test_every_engine_arg_has_help_in_serve() -> None:
    parser = serve_parser()
    actions = {a.dest: a for a in parser._actions}
    text = parser.format_help()
    for f in fields(EngineArgs):
        assert f.metadata.get("help"), f"EngineArgs.{f.name} has no help"
        action = actions.get(f.name)
        assert action is not None and action.help and action.help.strip(), f"no help for {f.name}"
        if f.name != "model":  # serve's own positional, with its demo-model default
            assert action.help.startswith(f.metadata["help"]), f.name
            assert "--" + f.name.replace("_", "-") in text


def test_engine_options_parse_into_engine_args() -> None:
    parser = serve_parser()
    assert EngineArgs.from_cli_args(parser.parse_args(["m"])) == EngineArgs("m")
    ns = parser.parse_args(["m", "--max-num-seqs", "4", "--kv-cache-memory", "64MiB", "--no-enable-prefix-caching",
                            "--seed", "3", "--dtype", "float32", "--async-scheduling"])
    assert EngineArgs.from_cli_args(ns) == EngineArgs("m", max_num_seqs=4, kv_cache_memory="64MiB",
                                                      enable_prefix_caching=False, seed=3, dtype="float32",
                                                      async_scheduling=True)
