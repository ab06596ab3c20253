"""The layering in pyproject.toml's [tool.importlinter] contracts holds (lint-imports, over the static
import graph): core/ imports no torch and nothing above it, the torch-free descriptions stay so,
layers/, kernels/ and attention/ import nothing from the layers above them, and no import cycles."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _lint_imports(*args: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("lint-imports", path=os.path.dirname(sys.executable)) or shutil.which("lint-imports")
    if exe is None:
        pytest.fail("lint-imports is not installed (import-linter is a dev dependency: run `make bootstrap`)")
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")}
    return subprocess.run([exe, "--no-cache", *args], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)


def test_layering_contracts_hold() -> None:
    done = _lint_imports()
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout


def test_a_broken_contract_is_reported(tmp_path: os.PathLike[str]) -> None:
    # the checker really reads the graph: models/ imports torch, so forbidding it must fail
    config = os.path.join(tmp_path, "contracts.toml")
    with open(config, "w", encoding="utf-8") as f:
        f.write('[tool.importlinter]\nroot_package = "tokenmill"\ninclude_external_packages = true\n\n'
                '[[tool.importlinter.contracts]]\nname = "models without torch"\ntype = "forbidden"\n'
                'source_modules = ["tokenmill.models"]\nforbidden_modules = ["torch"]\n')
    done = _lint_imports("--config", config)
    assert done.returncode != 0 and "BROKEN" in done.stdout


def test_the_cli_and_the_api_process_import_no_torch() -> None:
    # `tokenmill serve` starts the engine core first and then imports the web stack and builds the CLI's
    # parser; torch there (1.3 s or more of import) would sit on the way to the first token, beside the
    # engine core's own. The engine's modules bring torch in where they use it.
    code = ("import sys, tokenmill.entrypoints.cli as c, tokenmill.entrypoints.openai.api_server, "
            "tokenmill.entrypoints.openai.app; c.build_parser(); print(sorted(m for m in sys.modules "
            "if m == 'torch' or m.startswith('torch.')))")
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]", done.stdout[:500]
