"""`tokenmill serve [MODEL]`: the OpenAI-compatible server (MODEL defaults to the shipped demo model)."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

from tokenmill.config import EngineArgs, default_async_scheduling, default_num_threads, resolve_device
from tokenmill.fast_exit import fast_exit

DEMO_MODEL = os.path.join("models", "tokenmill-demo")
STARTED_AT = time.time()  # imported while the CLI builds its parser: the reference for "ready in"
_REPO_ROOT = Path(__file__).resolve().parents[3]
# the exit statuses of openai/lifecycle.py (EXIT_*) and of cli.py's argument errors
EXIT_STATUS_HELP = ("exit status: 0 stopped by SIGTERM or Ctrl-C with every request finished; 1 the engine core "
                    "died (after ending every request with an error), or the server could not start; 2 bad "
                    "arguments (one line on stderr); 3 stopped, but requests still running at the end of "
                    "--shutdown-timeout were ended with an error")
# CPUs left to the API process (HTTP, tokenization, detokenization) when --num-threads is not given:
# compute threads that share a CPU with it are descheduled mid-step
API_PROCESS_CPUS = 1
DEFAULT_MAX_SEQUENCES_PER_REQUEST = 256
TOOL_PARSER_NAMES = ("hermes", "llama3_json", "mistral", "pythonic")  # openai/tool_parsers' registry


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                              description="Serve a Hugging Face checkpoint over an OpenAI-compatible HTTP API.",
                              epilog=EXIT_STATUS_HELP)
    p.add_argument("model", nargs="?", default=None,
                   help=f"checkpoint directory (default: the demo model, {DEMO_MODEL})")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000; 0: any free port)")
    p.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every route but /health, /ping, /metrics and "
                        "/version (or set TOKENMILL_API_KEY); repeat it for several callers, each seeing only its "
                        "own files and batches")
    p.add_argument("--chat-template", default=None, help="a Jinja chat template file (or template text) "
                   "that replaces the tokenizer's")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="let the model decide to call tools (tool_choice \"auto\", the default when a request "
                        "has tools); needs --tool-call-parser")
    p.add_argument("--tool-call-parser", default=None, choices=TOOL_PARSER_NAMES,
                   help="how tool calls are found in the model's text: the model family's format")
    p.add_argument("--max-queue-len", type=int, default=None,
                   help="sequences allowed to wait beyond --max-num-seqs; more get 429 (default: no limit)")
    p.add_argument("--request-timeout", type=float, default=None,
                   help="abort requests running longer than this many seconds (default: none)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM or Ctrl-C, new requests get 503 while those in flight run on for up to this "
                        "many seconds; then the rest end with an error (503, or an SSE error event) and the "
                        "server exits; a second signal ends them at once (default 30)")
    p.add_argument("--max-request-bytes", type=int, default=16 * 2**20, help="request body limit (413 above)")
    p.add_argument("--max-prompts-per-request", type=int, default=DEFAULT_MAX_SEQUENCES_PER_REQUEST,
                   help="the most sequences one request may fan out into, its prompts times n (20 prompts with "
                        "n=4 are 80); more get a 400 (default: %(default)s, or --max-num-seqs plus --max-queue-len "
                        "when --max-queue-len is set and that is less)")
    p.add_argument("--embed-batch-wait-ms", type=float, default=2.0, metavar="MS",
                   help="embedding servers (--runner pooling): the inputs of requests that arrive within this many "
                        "milliseconds of the first one waiting run as one batch, of up to --max-num-batched-tokens "
                        "tokens (default %(default)s)")
    p.add_argument("--register-with", default=None, metavar="ROUTER_URL",
                   help="register with a `tokenmill router` at this URL and heartbeat to it every few seconds")
    p.add_argument("--advertise-url", default=None, metavar="URL",
                   help="the URL the router reaches this server at (default http://HOST:PORT)")
    p.add_argument("--router-api-key", default=None, help="the router's --api-key, if it has one")
    p.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--uvicorn-log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    observability_args(p)
    serving_batch_args(p)
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=run, model_root=None)


def observability_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--slo", default=None, metavar="ttft_ms=..,tpot_ms=..",
                   help="the service-level objective goodput is measured against (/metrics, /dashboard): a request "
                        "meets it when its time to first token and time per output token are within these bounds")
    p.add_argument("--bandwidth", type=float, default=None, metavar="GBps",
                   help="memory read bandwidth MBU divides by (default: `tokenmill bench roofline`'s cached figure)")
    p.add_argument("--flops", type=float, default=None, metavar="GFLOPs",
                   help="peak GFLOP/s of the model's dtype MFU divides by (default: the roofline cache's)")
    p.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="send OpenTelemetry spans of every request (queue, prefill, decode, detokenize) to this "
                        "OTLP/HTTP endpoint, e.g. http://127.0.0.1:4318/v1/traces (needs the otel extra)")


def check_observability_args(args: argparse.Namespace) -> None:
    """Refuses bad values before the model loads (ValueError, one line)."""
    from tokenmill.metrics.slo import SLO
    from tokenmill.metrics.tracing import require_opentelemetry

    SLO.parse(args.slo)
    for flag in ("bandwidth", "flops"):
        value = getattr(args, flag)
        if value is not None and not value > 0:
            raise ValueError(f"--{flag} must be positive, got {value}")
    if args.otlp_traces_endpoint is not None:
        require_opentelemetry()


def serving_batch_args(p: argparse.ArgumentParser) -> None:
    from tokenmill.entrypoints.openai.batch_config import add_cli_args

    add_cli_args(p)


def resolve_model_args(args: argparse.Namespace) -> None:
    """MODEL defaults to the demo model, found from any directory. The API names the model as the
    argument was given (the demo's relative path when none was), never the absolute path it
    resolved to, as vLLM does; model_root keeps that name for /v1/models' root."""
    args.model_root = args.model if args.model is not None else DEMO_MODEL
    if args.served_model_name is None:
        args.served_model_name = args.model_root
    args.model = resolve_model(args.model)


def resolve_model(model: str | None) -> str:
    if model is not None:
        return model
    for candidate in (DEMO_MODEL, str(_REPO_ROOT / DEMO_MODEL)):
        if os.path.isdir(candidate):
            return candidate
    raise ValueError(f"no MODEL given and the demo model is missing ({DEMO_MODEL} in this directory or "
                     f"{_REPO_ROOT}); pass a checkpoint directory, or run `make serve` in the repository")


def load_chat_template(value: str | None) -> str | None:
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")


def run(args: argparse.Namespace) -> int:
    import asyncio

    from tokenmill.entrypoints.openai.api_server import run_server

    if args.max_queue_len is not None and args.max_queue_len < 0:
        raise ValueError(f"--max-queue-len must be >= 0, got {args.max_queue_len}")
    if args.request_timeout is not None and args.request_timeout <= 0:
        raise ValueError(f"--request-timeout must be positive, got {args.request_timeout}")
    if not 0 <= args.shutdown_timeout < float("inf"):
        raise ValueError(f"--shutdown-timeout must be a number of seconds >= 0, got {args.shutdown_timeout}")
    if args.max_prompts_per_request < 1:
        raise ValueError(f"--max-prompts-per-request must be >= 1, got {args.max_prompts_per_request}")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    check_observability_args(args)
    resolve_model_args(args)
    if args.api_key is None:
        args.api_key = os.environ.get("TOKENMILL_API_KEY") or None
    if args.num_threads is None:
        args.num_threads = default_num_threads(busy_cpus=API_PROCESS_CPUS)
    if args.async_scheduling is None:
        args.async_scheduling = default_async_scheduling(resolve_device(args.device), args.num_threads,
                                                         busy_cpus=API_PROCESS_CPUS)
    template = load_chat_template(args.chat_template)
    engine_args = EngineArgs.from_cli_args(args)
    try:
        config = engine_args.create_engine_config()
    except ValueError:
        config = None  # the generating server's start-up reports it, as for any engine that cannot start
    try:
        if config is not None and config.model.runner == "pooling":
            from tokenmill.entrypoints.openai.embedding_server import run_embedding_server

            code = asyncio.run(run_embedding_server(args, config, STARTED_AT))
        else:
            code = asyncio.run(run_server(args, engine_args, template, STARTED_AT, **_data_parallel(engine_args)))
    except KeyboardInterrupt:
        code = 130
    except SystemExit as e:  # SIGTERM while the engine loads
        code = e.code if isinstance(e.code, int) else 1
    fast_exit(code)  # both processes are down


def _data_parallel(engine_args: EngineArgs) -> dict[str, Any]:
    """The engine-core client over N replicas where --data-parallel-size N asks for them."""
    if engine_args.data_parallel_size == 1:
        return {}
    from tokenmill.entrypoints.router.data_parallel import DataParallelClient

    return {"client_factory": DataParallelClient}
