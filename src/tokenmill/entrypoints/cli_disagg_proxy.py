"""`tokenmill disagg-proxy --prefill URL ... --decode URL ...`: disaggregated prefill and decode behind one
OpenAI-compatible endpoint (entrypoints/router/disagg.py)."""

from __future__ import annotations

import argparse
from typing import Any

from tokenmill.entrypoints.cli_router import add_proxy_options, check_proxy_options


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
    add_proxy_options(p, "instance", "instances tried for one request's prefill, and for its decode")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from tokenmill.entrypoints.router.disagg import DisaggConfig, build_disagg_app

    check_proxy_options(args)
    if not args.decode:
        raise ValueError("give at least one --decode URL (and --prefill URLs for the prefill instances)")
    config = DisaggConfig(prefill=tuple(args.prefill), workers=tuple(args.decode), api_key=args.api_key or None,
                          worker_api_key=args.worker_api_key, health_interval=args.health_interval,
                          max_attempts=args.max_attempts, request_timeout=args.request_timeout)
    app = build_disagg_app(config)  # validates the URLs
    print(f"tokenmill disagg-proxy on http://{args.host}:{args.port}: {len(config.prefill)} prefill, "
          f"{len(config.decode)} decode instance(s)", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level)
    return 0
