"""`tokenmill bench serve`: an async load generator against any OpenAI-compatible server (tokenmill,
vLLM, ...). Requests stream (`stream: true`, usage in the last chunk) and arrive at --request-rate
(Poisson; gamma with --burstiness; all at once for inf), at most --max-concurrency in flight.
Per request: TTFT, inter-token latencies (gaps between chunks that carry output), TPOT, E2E latency
and token counts; summarized as vLLM's `bench serve` does, plus goodput under --slo. Failed requests
are counted and reported, never fatal. Only the --base-url given (and the --server-metrics URLs, whose
/metrics are read before and after the run: bench/serve_server_stats.py) is ever contacted."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import sys
import time
from typing import Any

import httpx
from tqdm import tqdm

from tokenmill.bench import serve_batch
from tokenmill.bench.results import ResultSink, emit
from tokenmill.bench.serve_client import RequestOptions, RequestResult, send
from tokenmill.bench.serve_data import (
    Chain,
    PromptMaker,
    arrival_offsets,
    default_vocab_high,
    jsonl_chains,
    load_tokenizer,
    random_chains,
    shared_prefix_chains,
)
from tokenmill.bench.serve_metrics import parse_slo, render, summarize, turn_stats
from tokenmill.bench.serve_server_stats import scrape, summarize_counters

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root, e.g. http://127.0.0.1:8000")
    p.add_argument("--endpoint", default="/v1/completions", choices=ENDPOINTS)
    p.add_argument("--model", default=None, help="model name sent in each request (default: the first of /v1/models)")
    p.add_argument("--dataset", default="random", choices=["random", "jsonl", "shared-prefix"])
    p.add_argument("--dataset-path", default=None, help="the JSONL file for --dataset jsonl")
    p.add_argument("--num-prompts", type=int, default=None, help="requests to send (default 256; jsonl: all)")
    p.add_argument("--input-len", default="128", help="A or A:B prompt tokens (random, shared-prefix)")
    p.add_argument("--output-len", default="128", help="C or C:D max_tokens (random, shared-prefix)")
    p.add_argument("--vocab-low", type=int, default=10)
    p.add_argument("--vocab-high", type=int, default=None,
                   help="random token ids below this (default: the tokenizer's or the local --model's vocab)")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory: send text prompts instead of token ids")
    p.add_argument("--prefix-len", type=int, default=0, help="shared-prefix: tokens of each shared prefix")
    p.add_argument("--num-prefixes", type=int, default=1, help="shared-prefix: distinct prefixes")
    p.add_argument("--turns", type=int, default=1, help="shared-prefix: turns per conversation")
    p.add_argument("--prefix-order", default="cycle", choices=["cycle", "random"],
                   help="shared-prefix: conversation c takes prefix c mod --num-prefixes (cycle), or one drawn "
                        "at random (random: no rotation of replicas lines up with the prefixes)")
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests/s, or inf (all at once)")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the gaps: 1 = Poisson, <1 burstier, inf = constant rate")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos: true (a vLLM extension)")
    p.add_argument("--extra-body", default=None, help="JSON object merged into every request body")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--slo", default=None, help="e.g. ttft_ms=500,tpot_ms=50 (also itl_ms, e2el_ms) for goodput")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=1, help="untimed requests first; a failing one stops the run")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.add_argument("--save-detailed", action="store_true", help="add per-request figures to the JSON")
    p.add_argument("--server-metrics", action="append", default=None, metavar="URL",
                   help="a server whose /metrics prefix-cache counters are read before and after the run and "
                        "summed (repeat, e.g. each replica behind a router; default: --base-url)")
    p.add_argument("--label", default=None, help="what the server is (tokenmill, vllm, ...), saved as 'engine'")
    p.add_argument("--batch-lines", type=int, default=0, metavar="N",
                   help="also submit a batch of N requests (made like the online ones, seed + 1) through the "
                        "server's /v1/files and /v1/batches when the online load starts, and report its completion "
                        "time and throughput (batch_* fields)")
    p.add_argument("--capacity", type=float, default=None, metavar="TOK_S",
                   help="the server's output throughput at saturation (a run at --request-rate inf): with "
                        "--batch-lines, the batch's throughput during the online load is also given as a fraction "
                        "of the capacity the online load leaves idle")


def build_chains(args: argparse.Namespace) -> list[Chain]:
    if args.num_prompts is not None and args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    tokenizer = load_tokenizer(args.tokenizer)
    maker = PromptMaker(tokenizer)
    if args.dataset == "jsonl":
        if not args.dataset_path:
            raise ValueError("--dataset jsonl needs --dataset-path FILE")
        chains = jsonl_chains(args.dataset_path, args.num_prompts, maker)
    else:
        vocab = (args.vocab_low, args.vocab_high or default_vocab_high(tokenizer, args.model))
        if not 0 <= vocab[0] < vocab[1]:
            raise ValueError(f"token ids must come from a non-empty range, got [{vocab[0]}, {vocab[1]})")
        num = args.num_prompts or 256
        if args.dataset == "random":
            chains = random_chains(num, args.input_len, args.output_len, vocab, args.seed, maker)
        else:
            chains = shared_prefix_chains(num, args.input_len, args.output_len, vocab, args.seed, maker,
                                          args.prefix_len, args.num_prefixes, args.turns, args.prefix_order)
    if "chat" in args.endpoint and any(not isinstance(r.prompt, str) for c in chains for r in c):
        raise ValueError("the chat endpoint needs text prompts: pass --tokenizer DIR or a JSONL with 'prompt'")
    return chains


def _extra_body(spec: str | None) -> dict[str, Any]:
    if not spec:
        return {}
    try:
        body = json.loads(spec)
    except ValueError as e:
        raise ValueError(f"--extra-body is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise ValueError("--extra-body must be a JSON object")
    return body


async def _model_name(client: httpx.AsyncClient) -> str:
    try:
        resp = await client.get("/v1/models")
        resp.raise_for_status()
        return str(resp.json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
        raise ValueError(f"cannot get the model name from /v1/models ({e}); pass --model") from None


async def bench(args: argparse.Namespace, chains: list[Chain], opts: RequestOptions,
                batch: list[Chain] | None = None) -> tuple[list[list[RequestResult]], float, RequestOptions,
                                                           dict[str, Any]]:
    """Sends every chain (and submits `batch` as a batch job at the start); returns the results per chain
    in request order, the duration, the options used and the batch's and the servers' figures."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, limits=limits, trust_env=False,
                                 timeout=httpx.Timeout(args.timeout)) as client:
        if not opts.model:
            opts = dataclasses.replace(opts, model=await _model_name(client))
        first = dataclasses.replace(chains[0][0], max_tokens=min(16, chains[0][0].max_tokens))
        for _ in range(args.warmup):
            r = await send(client, first, opts, time.perf_counter())
            if not r.ok:
                raise ValueError(f"the warm-up request to {args.base_url}{opts.endpoint} failed: {r.error}")
        metric_urls = args.server_metrics or [args.base_url]
        counters_before = await scrape(client, metric_urls)
        offsets = arrival_offsets(len(chains), args.request_rate, args.burstiness, args.seed)
        sem = asyncio.Semaphore(args.max_concurrency or sum(len(c) for c in chains))
        bar = tqdm(total=sum(len(c) for c in chains), disable=not args.progress, desc="requests", file=sys.stderr)
        submitted = await serve_batch.submit(client, serve_batch.batch_lines(batch, opts), opts.endpoint) \
            if batch else None
        t0 = time.perf_counter()

        async def run_chain(chain: Chain, offset: float) -> list[RequestResult]:
            await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
            out = []
            for req in chain:
                async with sem:
                    out.append(await send(client, req, opts, t0))
                bar.update(1)
            return out

        per_chain = await asyncio.gather(*(run_chain(c, o) for c, o in zip(chains, offsets)))
        duration = time.perf_counter() - t0
        bar.close()
        results = [r for rs in per_chain for r in rs]
        figures: dict[str, Any] = summarize_counters(counters_before, await scrape(client, metric_urls))
        if submitted is not None:
            tokens_now = await serve_batch.generation_tokens(client)
            figures |= await serve_batch.finish(client, submitted, time.perf_counter(),
                                               sum(r.output_tokens for r in results if r.ok), tokens_now)
    return list(per_chain), duration, opts, figures


def _detailed(results: list[RequestResult]) -> list[dict[str, Any]]:
    return [{"start_s": round(r.start_s, 4), "prompt_len": r.prompt_len, "output_tokens": r.output_tokens,
             "ttft_ms": None if r.ttft_s is None else round(r.ttft_s * 1e3, 3),
             "tpot_ms": None if r.tpot_s is None else round(r.tpot_s * 1e3, 3),
             "e2el_ms": round(r.e2e_s * 1e3, 3), "itl_ms": [round(g * 1e3, 3) for g in r.itl_s],
             "error": r.error} for r in results]


def run(args: argparse.Namespace) -> int:
    slo = parse_slo(args.slo)
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if not args.base_url.startswith(("http://", "https://")):
        raise ValueError(f"--base-url {args.base_url!r} must start with http:// or https://")
    if args.base_url.rstrip("/").endswith("/v1"):
        args.base_url = args.base_url.rstrip("/")[: -len("/v1")]  # the endpoint carries /v1
    chains = build_chains(args)
    if not chains:
        raise ValueError("the dataset holds no requests")
    arrival_offsets(1, args.request_rate, args.burstiness, args.seed)  # validates rate and burstiness
    opts = RequestOptions(args.endpoint, args.model or "", args.temperature, args.ignore_eos,
                          _extra_body(args.extra_body))
    if args.batch_lines < 0:
        raise ValueError(f"--batch-lines must be >= 0, got {args.batch_lines}")
    batch = build_chains(argparse.Namespace(**{**vars(args), "num_prompts": args.batch_lines, "seed": args.seed + 1})) \
        if args.batch_lines else None
    per_chain, duration, opts, figures = asyncio.run(bench(args, chains, opts, batch))
    results = [r for chain in per_chain for r in chain]
    summary = {**summarize(results, duration, slo), **turn_stats(per_chain), **figures}
    print(render(summary), file=sys.stderr)
    rate = "inf" if math.isinf(args.request_rate) else args.request_rate
    burst = "inf" if math.isinf(args.burstiness) else args.burstiness
    result: dict[str, Any] = {
        "engine": args.label, "bench": "serve", "base_url": args.base_url, "endpoint": args.endpoint,
        "model": opts.model, "dataset": args.dataset, "num_prompts": len(results), "request_rate": rate,
        "burstiness": burst, "max_concurrency": args.max_concurrency, "temperature": args.temperature,
        "ignore_eos": args.ignore_eos, "tokenizer": args.tokenizer, "seed": args.seed,
        "prefix_len": args.prefix_len if args.dataset == "shared-prefix" else None,
        "num_prefixes": args.num_prefixes if args.dataset == "shared-prefix" else None,
        "turns": args.turns if args.dataset == "shared-prefix" else None,
        "prefix_order": args.prefix_order if args.dataset == "shared-prefix" else None,
        "slo": slo or None, **summary,
    }
    if "batch_output_throughput_during_online" in figures and args.capacity:
        idle = args.capacity - summary["output_throughput"]
        during = figures["batch_output_throughput_during_online"]
        result.update(capacity_output_throughput=args.capacity, idle_output_throughput=round(idle, 2),
                      batch_fraction_of_idle=None if during is None or idle <= 0 else round(during / idle, 4))
    if args.save_detailed:
        result["detailed"] = _detailed(results)
    emit(result, ResultSink.from_args(args))
    return 0
