"""Where and how benchmark results are written: one JSON object per run, with the machine,
the commit and the command recorded beside the figures. Printed on stdout, and written to an
indented JSON file (`--output-json`) or appended as one line to a JSON-Lines file (`--output-jsonl`)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

from tokenmill.cpu_features import isa_flags
from tokenmill.metrics.ceilings import cpu_name


def sig(x: float, digits: int = 4) -> float:
    """x to `digits` significant digits (tiny models give tiny figures; fixed decimals would zero them)."""
    return float(f"{x:.{digits}g}")


def require_positive(args: Any, *flags: str) -> None:
    """A ValueError naming the first of these options (argparse dests) that is below 1."""
    for flag in flags:
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")


def peak_rss_mb() -> float:
    """This process's peak resident memory. VmHWM where Linux has it: ru_maxrss keeps the
    forking parent's size across exec, which misreports a small child of a big parent."""
    try:
        with open("/proc/self/status", encoding="utf-8") as f:
            return next(int(ln.split()[1]) for ln in f if ln.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration, ValueError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def loaded_weight_bytes(llm: Any) -> int:
    """The model's parameter bytes as the (first) worker holds them in memory."""
    return int(llm.engine.core.executor.collective_rpc("weight_bytes")[0])


def gpu_pdl(device: str, attention_backend: str) -> bool | None:
    """Whether the Triton kernels launch with programmatic dependent launch on `device` (kernels/triton/common.py);
    None where no Triton kernel runs (the CPU, or another attention backend on a GPU)."""
    if not device.startswith("cuda") or attention_backend != "triton":
        return None
    import torch

    from tokenmill.kernels.triton.common import use_pdl
    return use_pdl(torch.device(device))


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def machine() -> dict[str, Any]:
    return {"cpu": cpu_name(), "isa": isa_flags(), "cores": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version()}


def add_output_args(p: argparse.ArgumentParser) -> None:
    """The options by which every bench subcommand records its result (read by ResultSink.from_args)."""
    p.add_argument("--output-json", default=None, metavar="FILE",
                   help="write the result to FILE as one indented JSON object, replacing FILE")
    p.add_argument("--output-jsonl", default=None, metavar="FILE",
                   help="append the result to FILE as one JSON line, creating FILE if needed")
    p.add_argument("--result-name", default=None, metavar="NAME",
                   help="saved first in the result as its 'result' key, the name it is cited by")


def unwritable(path: str) -> str | None:
    """Why `path` could not be written (the missing folders above it created first), or None.
    Creates nothing, so a bad path is reported before a bench runs rather than after."""
    target = os.path.abspath(path)
    if os.path.isdir(target):
        return "is a directory"
    if os.path.exists(target):
        return None if os.access(target, os.W_OK) else "is not writable"
    parent = os.path.dirname(target)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"{parent} is not a directory"
    return None if os.access(parent, os.W_OK | os.X_OK) else f"cannot create files in {parent}"


def _write(flag: str, path: str, mode: str, text: str) -> None:
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, mode, encoding="utf-8") as f:
            f.write(text)
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot write it ({e.strerror or e})") from None


@dataclass(frozen=True)
class ResultSink:
    """Where a result goes besides stdout, and the name it is cited by (its `result` key)."""

    json_path: str | None = None
    jsonl_path: str | None = None
    name: str | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ResultSink:
        return cls(args.output_json, args.output_jsonl, args.result_name)

    def check(self) -> None:
        """A ValueError naming the option whose file cannot be written."""
        for flag, path in (("--output-json", self.json_path), ("--output-jsonl", self.jsonl_path)):
            reason = unwritable(path) if path else None
            if reason:
                raise ValueError(f"{flag} {path}: {reason}")

    def write(self, record: dict[str, Any]) -> None:
        if self.json_path:
            _write("--output-json", self.json_path, "w", json.dumps(record, indent=2) + "\n")
        if self.jsonl_path:
            _write("--output-jsonl", self.jsonl_path, "a", json.dumps(record) + "\n")


def emit(result: dict[str, Any], sink: ResultSink) -> None:
    """Print the result, with its name and provenance, on stdout and write it where `sink` says."""
    head = {} if sink.name is None else {"result": sink.name}
    record = {**head, **result, "commit": git_commit(), "command": " ".join(["tokenmill", *sys.argv[1:]]),
              "machine": machine(), "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    print(json.dumps(record))
    sink.write(record)
