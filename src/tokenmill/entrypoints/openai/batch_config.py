"""The Files and Batch API's settings and their `tokenmill serve` flags (light: the CLI imports it
while building its parser)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

import platformdirs

DEFAULT_MAX_FILE_BYTES = 200 * 10**6  # OpenAI's limit for a batch input file


@dataclass(frozen=True)
class BatchConfig:
    directory: str  # --batch-dir
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES  # --max-batch-file-bytes
    lines_in_flight: int = 64  # --batch-lines-in-flight: each batch's requests in the engine at once


def default_batch_dir() -> str:
    """Under the user's data directory (XDG_DATA_HOME on Linux)."""
    return os.path.join(platformdirs.user_data_dir("tokenmill", appauthor=False), "batches")


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-dir", default=None, metavar="DIR",
                   help="where the Files and Batch API keep their files and database (default: "
                        f"{default_batch_dir()}); a restarted server resumes the unfinished batches in it")
    p.add_argument("--max-batch-file-bytes", type=int, default=DEFAULT_MAX_FILE_BYTES, metavar="BYTES",
                   help="the largest file /v1/files takes; larger is a 400 (default: %(default)s, OpenAI's)")
    p.add_argument("--batch-lines-in-flight", type=int, default=64, metavar="N",
                   help="each running batch's lines in the engine at once, in the batch priority class "
                        "(default %(default)s)")


def config_from_args(args: argparse.Namespace) -> BatchConfig:
    if args.max_batch_file_bytes < 1:
        raise ValueError(f"--max-batch-file-bytes must be >= 1, got {args.max_batch_file_bytes}")
    if args.batch_lines_in_flight < 1:
        raise ValueError(f"--batch-lines-in-flight must be >= 1, got {args.batch_lines_in_flight}")
    return BatchConfig(args.batch_dir or default_batch_dir(), args.max_batch_file_bytes, args.batch_lines_in_flight)


