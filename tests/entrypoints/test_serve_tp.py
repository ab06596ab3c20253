"""`tokenmill serve MODEL --tensor-parallel-size 2` (and `--pipeline-parallel-size 2`): the OpenAI server
over two worker processes generates what one rank does; a worker killed under load ends the requests in
flight with an error and the server exits non-zero within seconds (as for a dead engine core); a size
the model's heads (or its layers) do not allow is one line at start."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.entrypoints.server import RemoteServer, free_port
from tests.entrypoints.test_serve_cli import assert_one_line_error, serve
from tests.entrypoints.test_serve_lifecycle import LONG, assert_stream_error, exit_code, stream_lines
from tokenmill import LLM, SamplingParams

PROMPTS = ["def main():", "import os\nimport sys", "class Parser:\n    def"]


def worker_pids(core_pid: int) -> list[int]:
    """The engine core's worker processes (spawned; not multiprocessing's resource tracker)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().split(")")[-1].split()[1])
            with open(f"/proc/{entry}/cmdline") as f:
                cmdline = f.read()
        except OSError:
            continue
        if ppid == core_pid and "spawn_main" in cmdline:
            pids.append(int(entry))
    return pids


@pytest.mark.parametrize("flag", ["--tensor-parallel-size", "--pipeline-parallel-size"])
def test_serve_parallel(llama_dir: str, flag: str) -> None:
    one_rank = LLM(llama_dir, kv_cache_memory="8MiB")
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = [o.outputs[0].text for o in one_rank.generate(PROMPTS, params, use_tqdm=False)]
    srv = RemoteServer(llama_dir, flag, "2")
    try:
        assert len(worker_pids(srv.core_pid)) == 2
        with srv.client() as http:
            r = http.post("/v1/completions", json={"prompt": PROMPTS, "max_tokens": 12, "temperature": 0.0,
                                                   "ignore_eos": True})
            assert r.status_code == 200, r.text
            assert [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])] == expected
            assert http.get("/health").status_code == 200
    finally:
        assert srv.stop() == 0


def test_killed_worker_ends_requests_and_the_server_exits(llama_dir: str) -> None:
    srv = RemoteServer(llama_dir, "--tensor-parallel-size", "2")
    try:
        workers = worker_pids(srv.core_pid)
        with ThreadPoolExecutor(1) as pool:
            started = threading.Event()
            stream = pool.submit(stream_lines, srv, LONG, started=started.set)
            assert started.wait(30), "the stream never started"
            os.kill(workers[-1], signal.SIGKILL)
            killed = time.monotonic()
            assert_stream_error(stream.result(10))
        assert exit_code(srv, 10) != 0 and time.monotonic() - killed < 10
        assert "died (killed by SIGKILL)" in srv.output()
    finally:
        srv.stop()


def test_size_the_heads_do_not_divide(llama_dir: str) -> None:
    result = serve(llama_dir, "--port", str(free_port()), "--tensor-parallel-size", "3")
    assert_one_line_error(result, "tensor_parallel_size 3 must divide the model's 4 attention heads")


def test_more_stages_than_layers(llama_dir: str) -> None:
    result = serve(llama_dir, "--port", str(free_port()), "--pipeline-parallel-size", "3")
    assert_one_line_error(result, "pipeline_parallel_size 3 is more than the model's 2 layers")
