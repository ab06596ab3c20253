"""`tokenmill serve`'s live observability: the step metrics, goodput and vLLM aliases in /metrics,
/dashboard behind the API key (header, ?api_key= or its cookie), its SSE feed, and the page itself in a
real headless Chromium (playwright driving the system's browser): no console errors, its numbers
match /metrics while a load runs, and it keeps updating."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.entrypoints.server import RemoteServer

KEY = "dash-key"
SLO_FLAG = "ttft_ms=60000,tpot_ms=60000"  # generous: every request of a tiny model meets it


@pytest.fixture(scope="module")
def server(llama_dir: str) -> Iterator[RemoteServer]:
    srv = RemoteServer(llama_dir, "--served-model-name", "tiny", "--slo", SLO_FLAG, "--bandwidth", "10",
                       "--flops", "100", "--kv-offload-memory", "16MiB", api_key=KEY)
    try:
        yield srv
    finally:
        srv.stop()


def metric_values(srv: RemoteServer) -> dict[str, float]:
    text = httpx.get(f"{srv.url}/metrics", timeout=30).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def complete(srv: RemoteServer, max_tokens: int = 16) -> None:
    with srv.client() as c:
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": "hello world " * 4,
                                            "max_tokens": max_tokens, "ignore_eos": True})
        assert r.status_code == 200, r.text


def test_metrics_have_step_rates_goodput_kv_and_vllm_names(server: RemoteServer) -> None:
    for _ in range(3):
        complete(server)
    m = metric_values(server)
    assert m["tokenmill:step_decode_tokens_total"] >= 3 * 15 and m["tokenmill:step_prefill_tokens_total"] > 0
    assert m["tokenmill:step_bytes_total"] > 0 and m["tokenmill:step_flops_total"] > 0
    assert 0 < m["tokenmill:model_bandwidth_utilization"] <= 1 and 0 < m["tokenmill:model_flops_utilization"] <= 1
    assert m["tokenmill:roofline_memory_bandwidth_bytes_per_second"] >= 10e9
    assert m["tokenmill:slo_requests_total"] >= 3 and m["tokenmill:slo_met_requests_total"] >= 3
    assert m["tokenmill:slo_attainment_ratio"] == 1.0 and m["tokenmill:goodput_requests_per_second"] > 0
    blocks = sum(m[f"tokenmill:kv_cache_blocks{{state={s}}}"] for s in ("used", "cached", "free"))
    assert blocks == m["tokenmill:kv_cache_total_blocks"]
    assert m["vllm:generation_tokens_total"] == m["tokenmill:generation_tokens_total"]
    assert m["tokenmill:plan_kv_capacity_tokens"] > 0


def test_dashboard_needs_the_key_and_takes_it_three_ways(server: RemoteServer) -> None:
    url = server.url
    assert httpx.get(f"{url}/dashboard/").status_code == 401
    assert httpx.get(f"{url}/dashboard/snapshot.json", params={"api_key": "wrong"}).status_code == 401
    page = httpx.get(f"{url}/dashboard", params={"api_key": KEY}, follow_redirects=True)
    assert page.status_code == 200 and "<title>tokenmill dashboard</title>" in page.text
    cookie = page.cookies.get("tokenmill_api_key")
    assert cookie == KEY
    for name in ("dashboard.js", "dashboard.css"):
        r = httpx.get(f"{url}/dashboard/static/{name}", cookies={"tokenmill_api_key": KEY})
        assert r.status_code == 200 and len(r.content) > 100
    assert httpx.get(f"{url}/dashboard/static/x.py", headers=server.headers).status_code == 404
    snap = httpx.get(f"{url}/dashboard/snapshot.json", headers=server.headers).json()
    assert snap["model"] == "tiny" and snap["kv_blocks"]["total"] > 0 and snap["goodput"]["slo"] == SLO_FLAG
    assert snap["plan"]["capacity_tokens"] > 0
    # the key opens the dashboard's routes only: an API route still wants the header
    assert httpx.get(f"{url}/v1/models", params={"api_key": KEY}).status_code == 401
    with httpx.stream("GET", f"{url}/dashboard/events", cookies={"tokenmill_api_key": KEY}, timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        line = next(ln for ln in r.iter_lines() if ln.startswith("data: "))
    assert json.loads(line[len("data: "):])["model"] == "tiny"


# ---- the page in a real browser ----------------------------------------------------------------

def chromium_path() -> str | None:
    """The system's Chromium; installed with apt-get where it is missing and this runs as root."""
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    if os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "install", "-y", "chromium"], env=env, capture_output=True, timeout=900,
                       check=False)
        return shutil.which("chromium")
    return None


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install '.[dev]')")
    path = chromium_path()
    if path is None:
        pytest.skip("no Chromium on this machine and none could be installed (apt-get install chromium as root)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=path, headless=True, args=["--no-sandbox"])
        try:
            yield b
        finally:
            b.close()


class Load:
    """Completions from a few threads until stopped."""

    def __init__(self, srv: RemoteServer, threads: int = 3) -> None:
        self.stop = threading.Event()
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._run, args=(srv,)) for _ in range(threads)]

    def _run(self, srv: RemoteServer) -> None:
        while not self.stop.is_set():
            try:
                complete(srv, 48)
            except Exception as e:  # noqa: BLE001 - reported by the test
                self.errors.append(repr(e))
                return

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(120)


def shown(page: Any, element_id: str) -> float:
    return float(page.inner_text(f"#{element_id}").replace(",", ""))


def wait_for_update_after(page: Any, t: float) -> None:
    page.wait_for_function(f"Number(document.body.dataset.snapshotTime || 0) > {t}", timeout=30_000)


def test_dashboard_in_a_browser_under_load(server: RemoteServer, browser: Any, tmp_path: Path) -> None:
    page = browser.new_page(viewport={"width": 1400, "height": 1100})
    problems: list[str] = []
    page.on("console", lambda msg: problems.append(msg.text) if msg.type == "error" else None)
    page.on("pageerror", lambda err: problems.append(str(err)))
    page.goto(f"{server.url}/dashboard?api_key={KEY}")
    wait_for_update_after(page, 0)
    with Load(server) as load:
        complete(server)
        steps_seen = []
        for _ in range(3):  # the numbers it shows lie between two /metrics reads around its snapshot
            before, t = metric_values(server), time.time()
            wait_for_update_after(page, t)
            gen, finished = shown(page, "generation-tokens"), shown(page, "finished-requests")
            steps = shown(page, "steps")
            after = metric_values(server)
            assert before["tokenmill:generation_tokens_total"] <= gen <= after["tokenmill:generation_tokens_total"]
            finished_before = sum(v for k, v in before.items() if k.startswith("tokenmill:request_finished_total"))
            finished_after = sum(v for k, v in after.items() if k.startswith("tokenmill:request_finished_total"))
            assert finished_before <= finished <= finished_after
            assert shown(page, "kv-total") == after["tokenmill:kv_cache_total_blocks"]
            # the second tier's row: the memory tier is on, the disk tier off
            assert page.is_visible("#tier-memory") and not page.is_visible("#tier-disk")
            capacity = after["tokenmill:kv_offload_capacity_bytes{tier=memory}"]
            assert shown(page, "tier-memory-capacity") * 2**20 == capacity == 16 * 2**20
            assert shown(page, "tier-memory-cached") == after["tokenmill:kv_offload_blocks{state=cached,tier=memory}"]
            steps_seen.append(steps)
        mbu = page.inner_text("#mbu")
        assert mbu.endswith("%") and 0 < float(mbu[:-1]) <= 100
        assert page.inner_text("#slo") == SLO_FLAG and page.inner_text("#status") == "live"
        assert float(page.inner_text("#bandwidth-ceiling")) >= 10.0
        page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
    assert not load.errors, load.errors
    assert steps_seen == sorted(steps_seen) and steps_seen[-1] > steps_seen[0]  # it keeps updating
    assert not problems, problems
    assert (tmp_path / "dashboard.png").stat().st_size > 10_000
    page.close()
