"""`tokenmill serve`'s arguments: the model is named as the argument was given (the demo model,
found from any directory, keeps its relative name), and --max-prompts-per-request becomes the
per-request sequence limit, capped by the queue when there is one."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from tests.entrypoints.test_cli_help import serve_parser
from tokenmill.entrypoints.cli_serve import DEMO_MODEL, resolve_model_args
from tokenmill.entrypoints.openai.api_server import max_sequences_per_request


def parse(*argv: str) -> argparse.Namespace:
    return serve_parser().parse_args(list(argv))


def test_the_demo_model_is_named_as_given_from_any_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # not the repository: the demo model resolves to an absolute path
    args = parse()
    resolve_model_args(args)
    assert os.path.isabs(args.model) and os.path.isdir(args.model)
    assert args.served_model_name == DEMO_MODEL == args.model_root


def test_a_model_argument_is_its_own_name() -> None:
    args = parse("some/dir/")
    resolve_model_args(args)
    assert (args.model, args.served_model_name, args.model_root) == ("some/dir/", "some/dir/", "some/dir/")
    args = parse("some/dir", "--served-model-name", "tiny")
    resolve_model_args(args)
    assert (args.served_model_name, args.model_root) == ("tiny", "some/dir")


def test_max_prompts_per_request() -> None:
    assert max_sequences_per_request(parse("m"), max_num_seqs=256) == 256
    assert max_sequences_per_request(parse("m", "--max-prompts-per-request", "1000"), max_num_seqs=256) == 1000
    assert max_sequences_per_request(parse("m", "--max-queue-len", "4"), max_num_seqs=4) == 8  # all that fits
    assert max_sequences_per_request(parse("m", "--max-queue-len", "400", "--max-prompts-per-request", "9"),
                                     max_num_seqs=4) == 9
