"""Where and how benchmark results are written: one JSON object per run, with the machine,
the commit and the command recorded beside the figures."""

from __future__ import annotations

import json
import os
import platform
import resource
import subprocess
import sys
import time
from typing import Any


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


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def machine() -> dict[str, Any]:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version()}


def emit(result: dict[str, Any], output_json: str | None) -> None:
    result = {**result, "commit": git_commit(), "command": " ".join(["tokenmill", *sys.argv[1:]]),
              "machine": machine(), "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    text = json.dumps(result, indent=None)
    print(text)
    if output_json:
        os.makedirs(os.path.dirname(os.path.abspath(output_json)), exist_ok=True)
        with open(output_json, "w", encoding="utf-8") as f:
            f.write(json.dumps(result, indent=2) + "\n")
