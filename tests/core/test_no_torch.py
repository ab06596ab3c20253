"""core/ is pure Python: importing the scheduler must not import torch (DESIGN.md §5)."""

from __future__ import annotations

import subprocess
import sys


def test_core_imports_no_torch() -> None:
    code = ("import sys, tokenmill.core.scheduler, tokenmill.core.kv_cache_manager, tokenmill.core.messages; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
