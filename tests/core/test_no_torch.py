"""core/ is pure Python: importing the scheduler must not import torch (DESIGN.md §5)."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_core_imports_no_torch() -> None:
    code = ("import sys, tokenmill.core.scheduler, tokenmill.core.kv_cache_manager, tokenmill.core.messages, "
            "tokenmill.arch, tokenmill.kv_cache_spec; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_engine_config_imports_no_torch_on_a_cpu_machine() -> None:
    # the API process validates the config while the core process imports torch: on a machine
    # with no GPU device node it must not import torch itself (cold start of `tokenmill serve`)
    from tokenmill.config import _gpu_device_nodes

    if _gpu_device_nodes():
        pytest.skip("a GPU machine: resolving device=auto asks torch, by design")
    code = ("import sys; from tokenmill.config import EngineArgs; "
            "c = EngineArgs(model='models/tokenmill-demo').create_engine_config(); "
            "sys.exit(1 if 'torch' in sys.modules or c.device.device != 'cpu' else 0)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
