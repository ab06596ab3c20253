"""`tokenmill serve` refuses what it cannot serve with one clear line and exit status 2, before it
loads anything: a port out of range, a port in use, a checkpoint whose dtype it does not know."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys

import pytest

from tests.entrypoints.server import free_port
from tokenmill.config import EngineArgs


def serve(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TOKENMILL_API_KEY": ""}
    return subprocess.run([sys.executable, "-m", "tokenmill.entrypoints.cli", "serve", *args, "--host", "127.0.0.1",
                           "--kv-cache-memory", "64MiB", "--max-model-len", "512"],
                          capture_output=True, text=True, timeout=120, env=env)


def assert_one_line_error(result: subprocess.CompletedProcess[str], *words: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = (result.stdout + result.stderr).strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tokenmill: error: "), lines
    for word in words:
        assert word in lines[0], lines[0]


def test_port_out_of_range(llama_dir: str) -> None:
    assert_one_line_error(serve(llama_dir, "--port", "70000"), "--port", "70000")


def test_port_in_use(llama_dir: str) -> None:
    with socket.socket() as s:
        port = free_port()
        s.bind(("127.0.0.1", port))
        s.listen()
        assert_one_line_error(serve(llama_dir, "--port", str(port)), str(port), "in use")


@pytest.fixture
def unknown_dtype_dir(llama_dir: str, tmp_path: str) -> str:
    d = os.path.join(tmp_path, "float8_e9m9")
    shutil.copytree(llama_dir, d)
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    cfg.pop("dtype", None)
    cfg["torch_dtype"] = "float8_e9m9"
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    return d


def test_unknown_checkpoint_dtype_is_refused(unknown_dtype_dir: str) -> None:
    assert_one_line_error(serve(unknown_dtype_dir, "--port", str(free_port())), "'float8_e9m9'", "--dtype")
    with pytest.raises(ValueError, match="'float8_e9m9'"):
        EngineArgs(unknown_dtype_dir).create_engine_config()
    assert EngineArgs(unknown_dtype_dir, dtype="float32").create_engine_config().model.dtype == "float32"


@pytest.mark.parametrize("flags, words", [
    (["--kv-offload-disk-size", "1GiB"], ["kv_offload_disk", "go together"]),
    (["--preemption-mode", "swap"], ["preemption_mode swap", "kv_offload_memory"]),
    (["--kv-offload-memory", "lots"], ["kv_offload_memory", "'lots'"]),
])
def test_bad_kv_tier_flags_are_refused(llama_dir: str, flags: list[str], words: list[str]) -> None:
    assert_one_line_error(serve(llama_dir, "--port", str(free_port()), *flags), *words)
