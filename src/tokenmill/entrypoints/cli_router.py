"""`tokenmill router --worker URL ...`: an OpenAI-compatible router over `tokenmill serve` replicas."""

from __future__ import annotations

import argparse
import os
from typing import Any

from tokenmill.entrypoints.router.pool import POLICIES


def add_proxy_options(p: argparse.ArgumentParser, backend: str, attempts_help: str) -> None:
    """The options `tokenmill router` and `tokenmill disagg-proxy` share; `backend` names what they front
    ("replica", "instance")."""
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    p.add_argument("--api-key", default=os.environ.get("TOKENMILL_API_KEY"),
                   help="require 'Authorization: Bearer KEY' from clients (or set TOKENMILL_API_KEY)")
    p.add_argument("--worker-api-key", default=None,
                   help=f"the key sent to the {backend}s (default: the client's Authorization header is passed on)")
    p.add_argument("--health-interval", type=float, default=1.0, metavar="SECONDS",
                   help=f"probe each {backend}'s /health this often (default %(default)s)")
    p.add_argument("--max-attempts", type=int, default=3, help=attempts_help + " (default %(default)s)")
    p.add_argument("--request-timeout", type=float, default=600.0, metavar="SECONDS",
                   help=f"the longest one {backend} may take to answer (default %(default)s)")
    p.add_argument("--uvicorn-log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])


def check_proxy_options(args: argparse.Namespace) -> None:
    if not 0 < args.port < 65536:
        raise ValueError(f"--port {args.port} is not a TCP port (1-65535)")
    if args.health_interval <= 0 or args.max_attempts < 1 or args.request_timeout <= 0:
        raise ValueError("--health-interval and --request-timeout must be > 0 and --max-attempts >= 1")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "router", help="route OpenAI API requests over several tokenmill serve replicas",
        description="One OpenAI-compatible endpoint in front of several replicas: health-probed, routed by "
                    "prefix affinity (the replica that served a prompt's prefix gets the next prompt sharing "
                    "it) within a bound on imbalance, failed over when a replica dies.")
    p.add_argument("--worker", action="append", default=[], metavar="URL",
                   help="a replica's root URL, e.g. http://127.0.0.1:8001 (repeat; replicas may also register "
                        "with POST /router/workers {\"url\": ...})")
    add_proxy_options(p, "replica", "replicas tried for one request before it fails with 503")
    p.add_argument("--policy", default="prefix", choices=POLICIES,
                   help="prefix: the replica holding the longest prefix of the prompt, unless it is too loaded; "
                        "least_load: fewest requests in flight; round_robin (default: prefix)")
    p.add_argument("--balance-abs", type=int, default=8,
                   help="prefix policy: leave the prefix's replica for the least loaded one when it has more than "
                        "this many requests in flight above it ... (default %(default)s)")
    p.add_argument("--balance-rel", type=float, default=1.5,
                   help="... and more than this many times its load (default %(default)s)")
    p.add_argument("--max-failures", type=int, default=3,
                   help="failed probes in a row that take a replica out of routing (default %(default)s); "
                        "a refused or reset connection takes it out at once")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from tokenmill.entrypoints.router.app import RouterConfig, build_app

    check_proxy_options(args)
    config = RouterConfig(workers=tuple(args.worker), policy=args.policy, api_key=args.api_key or None,
                          worker_api_key=args.worker_api_key, health_interval=args.health_interval,
                          max_failures=args.max_failures, max_attempts=args.max_attempts,
                          balance_abs=args.balance_abs, balance_rel=args.balance_rel,
                          request_timeout=args.request_timeout)
    app = build_app(config)  # validates the policy, bounds and worker URLs
    print(f"tokenmill router on http://{args.host}:{args.port} over {len(config.workers)} worker(s), "
          f"policy {config.policy}", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level)
    return 0
