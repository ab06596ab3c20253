"""A real `tokenmill serve` subprocess on a free 127.0.0.1 port, for server tests."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import IO

import httpx

STARTUP_TIMEOUT = 180.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RemoteServer:
    def __init__(self, model: str, *extra: str, api_key: str | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        args = [sys.executable, "-m", "tokenmill.entrypoints.cli", "serve", model, "--host", "127.0.0.1",
                "--port", str(self.port), "--kv-cache-memory", "64MiB", "--max-model-len", "512", *extra]
        if api_key:
            args += ["--api-key", api_key]
        if "--batch-dir" not in extra:  # never the user's own data directory
            self._batch_dir = tempfile.TemporaryDirectory(prefix="tm-batches-")
            args += ["--batch-dir", self._batch_dir.name]
        self.log: IO[str] = tempfile.TemporaryFile("w+")
        env = {**os.environ, "TOKENMILL_API_KEY": "", "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        self.core_pid = self._wait_ready()

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def _wait_ready(self) -> int:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            # a generating server names its engine core process; an embedding server runs in one process
            m = re.search(r"tokenmill serving .* \((?:engine core )?pid (\d+)", self.output())
            if m:
                return int(m.group(1))
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server not ready after {STARTUP_TIMEOUT}s:\n{self.output()}")

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=60)

    def core_alive(self) -> bool:
        try:
            os.kill(self.core_pid, 0)
        except OSError:
            return False
        with open(f"/proc/{self.core_pid}/stat") as f:  # a zombie is not alive
            return f.read().split(")")[-1].split()[0] != "Z"

    def stop(self) -> int | None:
        """SIGTERM, as a user would; returns the exit code. Kills leftovers, so a test never leaks."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: the server and its core
                self.proc.wait(5)
        deadline = time.monotonic() + 5
        while self.core_alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        leaked = self.core_alive()
        if leaked:
            os.kill(self.core_pid, signal.SIGKILL)
        self.log.close()
        assert not leaked, "the engine core outlived the server"
        return self.proc.returncode
