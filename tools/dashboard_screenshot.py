"""Screenshot of /dashboard under load, for docs/: starts `tokenmill serve` on a model, keeps a few
completion streams running, waits for the dashboard to fill and saves a full-page PNG (playwright
driving the system's Chromium; no browser download).

    python tools/dashboard_screenshot.py [--model models/tokenmill-demo] [--port 8230] \
        [--out docs/dashboard.png] [--seconds 20] [--slo ttft_ms=500,tpot_ms=50] [-- SERVE OPTIONS]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import threading
import time

import httpx


def load(url: str, model: str, stop: threading.Event) -> None:
    with httpx.Client(base_url=url, timeout=120) as c:
        while not stop.is_set():
            c.post("/v1/completions", json={"model": model, "prompt": "Once upon a time " * 8, "max_tokens": 96,
                                            "ignore_eos": True})


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/tokenmill-demo")
    p.add_argument("--port", type=int, default=8230)
    p.add_argument("--out", default="docs/dashboard.png")
    p.add_argument("--seconds", type=float, default=20.0, help="load before the screenshot")
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--slo", default="ttft_ms=500,tpot_ms=50")
    p.add_argument("serve_args", nargs="*", help="more `tokenmill serve` options, after --")
    args = p.parse_args()
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        print("no chromium on PATH (apt-get install chromium)", file=sys.stderr)
        return 1
    url = f"http://127.0.0.1:{args.port}"
    server = subprocess.Popen([sys.executable, "-m", "tokenmill.entrypoints.cli", "serve", args.model, "--port",
                               str(args.port), "--slo", args.slo, "--served-model-name", "demo", *args.serve_args])
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        stop = threading.Event()
        threads = [threading.Thread(target=load, args=(url, "demo", stop)) for _ in range(args.streams)]
        for t in threads:
            t.start()
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium, headless=True, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"{url}/dashboard")
            time.sleep(args.seconds)
            page.screenshot(path=args.out, full_page=True)
            browser.close()
        stop.set()
        for t in threads:
            t.join(120)
    finally:
        server.terminate()
        server.wait(60)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
