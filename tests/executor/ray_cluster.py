"""A local Ray cluster for the Ray executor's tests: `ray start --head --block` on 127.0.0.1 in a temp dir,
ended by SIGTERM (which stops the processes it started, and only those)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

from tests.entrypoints.server import free_port

START_TIMEOUT_S = 60.0
CLUSTER_CPUS = 4


@contextmanager
def local_ray_cluster(num_cpus: int = CLUSTER_CPUS) -> Iterator[str]:
    """The cluster's address (host:port) while it runs."""
    ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
    port = free_port()
    temp_dir = tempfile.mkdtemp(prefix="tmray-", dir="/tmp")  # (Ray's socket paths must stay short)
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(
        [ray_cli, "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--port", str(port),
         "--num-cpus", str(num_cpus), "--include-dashboard", "false", "--temp-dir", temp_dir,
         "--object-store-memory", str(100 * 2**20), "--disable-usage-stats"],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            log.seek(0)
            if "block forever" in log.read():
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                raise RuntimeError(f"ray start failed:\n{log.read()}")
            time.sleep(0.2)
        yield f"127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
        for _ in range(10):  # (Ray's processes may still be writing their logs as they end)
            shutil.rmtree(temp_dir, ignore_errors=True)
            if not os.path.exists(temp_dir):
                break
            time.sleep(0.5)
        log.close()
