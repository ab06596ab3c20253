"""The Triton kernels compile for an H100 (sm_90), checked here with no GPU (compile_sm90.py, in its own
process: this one runs them under the interpreter where no GPU is present)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the kernel tests compile and run them there")
def test_kernels_compile_for_sm90(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")  # a fresh cache: really compiled
    done = subprocess.run([sys.executable, "-m", "tests.kernels.triton.compile_sm90"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert done.stdout.count("OK ") == 18
