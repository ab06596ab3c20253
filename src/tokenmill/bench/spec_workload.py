"""Speculative decoding in the benches: the acceptance figures every latency and throughput result
carries, and `tokenmill bench latency --dataset FILE.jsonl`, which times text prompts from a file (a
copy-heavy or a continuation workload, tools/spec_datasets.py) instead of random token ids."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

from tokenmill.bench.results import ResultSink, emit, peak_rss_mb, sig
from tokenmill.config import EngineArgs, EngineConfig
from tokenmill.core.messages import SchedulerStats, spec_decode_summary


def spec_fields(config: EngineConfig, before: SchedulerStats, after: SchedulerStats) -> dict[str, Any]:
    """The speculative config and the acceptance over the timed runs (empty figures when off)."""
    spec = config.speculative
    return {"speculative_method": spec.method if spec else None,
            "num_speculative_tokens": spec.num_speculative_tokens if spec else None,
            **spec_decode_summary(before, after)}


def read_dataset(path: str) -> list[str]:
    """The prompts of a JSONL file: one object a line with a "prompt" string."""
    if not os.path.isfile(path):
        raise ValueError(f"--dataset {path!r} is not a file")
    prompts = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                prompt = json.loads(line).get("prompt")
            except (json.JSONDecodeError, AttributeError):
                prompt = None
            if not isinstance(prompt, str) or not prompt:
                raise ValueError(f"--dataset {path}:{n}: each line must be a JSON object with a non-empty \"prompt\"")
            prompts.append(prompt)
    if not prompts:
        raise ValueError(f"--dataset {path!r} holds no prompt")
    return prompts


def run_dataset(args: argparse.Namespace, engine_args: EngineArgs) -> int:
    """Each run: every prompt of the file, --batch-size at a time, greedy, --output-len tokens each
    (EOS ignored), from an empty prefix cache; the median run's output tokens per second."""
    import torch

    from tokenmill.entrypoints.llm import LLM
    from tokenmill.sampling_params import SamplingParams

    texts = read_dataset(args.dataset)
    t0 = time.perf_counter()
    llm = LLM(model=args.model, **{k: v for k, v in vars(engine_args).items() if k != "model"})
    load_s = time.perf_counter() - t0
    config = llm.engine.config
    tok = llm.get_tokenizer()
    limit = config.model.max_model_len - args.output_len
    prompts: list[Any] = [{"prompt_token_ids": tok.encode(t)[-limit:]} for t in texts]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    b = args.batch_size
    for _ in range(args.warmup):
        llm.generate(prompts[:b], params.clone(max_tokens=min(16, args.output_len)), use_tqdm=False)
    stats0 = llm.engine.stats
    walls = []
    for _ in range(args.runs):
        llm.engine.reset_prefix_cache()
        t = time.perf_counter()
        for i in range(0, len(prompts), b):
            llm.generate(prompts[i:i + b], params, use_tqdm=False)
        walls.append(time.perf_counter() - t)
    tokens = len(prompts) * args.output_len
    wall = statistics.median(walls)
    emit({
        "engine": "tokenmill", "bench": "latency", "model": args.model, "dataset": args.dataset,
        "requests": len(prompts), "batch_size": b, "gen": args.output_len, "runs": args.runs,
        "threads": torch.get_num_threads(), "dtype": config.model.dtype, "device": config.device.device,
        "async_scheduling": config.scheduler.async_scheduling,
        "prompt_tokens": sum(len(p["prompt_token_ids"]) for p in prompts), "output_tokens": tokens,
        "total_s": round(wall, 5), "total_s_runs": [round(w, 5) for w in walls], "output_tok_s": sig(tokens / wall),
        "load_s": round(load_s, 2), "peak_rss_mb": round(peak_rss_mb(), 1), "loadavg": round(os.getloadavg()[0], 2),
        **spec_fields(config, stats0, llm.engine.stats),
    }, ResultSink.from_args(args))
    return 0
