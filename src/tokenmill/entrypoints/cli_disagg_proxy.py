"""`tokenmill disagg-proxy --prefill URL ... --decode URL ...`: disaggregated prefill and decode behind one
OpenAI-compatible endpoint (entrypoints/router/disagg.py)."""

from __future__ import annotations

import argparse
import os
from typing import Any


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "disagg-proxy", help="serve the OpenAI API over prefill and decode instances (disaggregated prefill/decode)",
        description="Each request is prefilled on a prefill instance (tokenmill serve --kv-transfer-config "
                    "'{\"kv_role\": \"kv_producer\", ...}'), which keeps the prompt's KV blocks, then decoded on a "
                    "decode instance (kv_role kv_consumer), which pulls them; both chosen by fewest requests in "
                    "flight. A request whose prefill fails is computed whole on the decode instance.")
    p.add_argument("--prefill", nargs="+", action="extend", default=[], metavar="URL",
                   help="prefill instances' root URLs, e.g. http://127.0.0.1:8100 (repeatable)")
    p.add_argument("--decode", nargs="+", action="extend", default=[], metavar="URL",
                   help="decode instances' root URLs, e.g. http://127.0.0.1:8200 (repeatable)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    p.add_argument("--api-key", default=os.environ.get("TOKENMILL_API_KEY"),
                   help="require 'Authorization: Bearer KEY' from clients (or set TOKENMILL_API_KEY)")
    p.add_argument("--worker-api-key", default=None,
                   help="the key sent to the instances (default: the client's Authorization header is passed on)")
    p.add_argument("--health-interval", type=float, default=1.0, metavar="SECONDS",
                   help="probe each instance's /health this often (default %(default)s)")
    p.add_argument("--max-attempts", type=int, default=3,
                   help="instances tried for one request's prefill, and for its decode (default %(default)s)")
    p.add_argument("--request-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="the longest an instance may take to answer (default %(default)s)")
    p.add_argument("--uvicorn-log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from tokenmill.entrypoints.router.disagg import DisaggConfig, build_disagg_app

    if not 0 < args.port < 65536:
        raise ValueError(f"--port {args.port} is not a TCP port (1-65535)")
    if args.health_interval <= 0 or args.max_attempts < 1 or args.request_timeout <= 0:
        raise ValueError("--health-interval and --request-timeout must be > 0 and --max-attempts >= 1")
    if not args.decode:
        raise ValueError("give at least one --decode URL (and --prefill URLs for the prefill instances)")
    config = DisaggConfig(prefill=tuple(args.prefill), decode=tuple(args.decode), api_key=args.api_key or None,
                          worker_api_key=args.worker_api_key, health_interval=args.health_interval,
                          max_attempts=args.max_attempts, request_timeout=args.request_timeout)
    app = build_disagg_app(config)  # validates the URLs
    print(f"tokenmill disagg-proxy on http://{args.host}:{args.port}: {len(config.prefill)} prefill, "
          f"{len(config.decode)} decode instance(s)", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level)
    return 0
