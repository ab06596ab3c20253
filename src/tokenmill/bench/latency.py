"""`tokenmill bench latency`: prefill time and per-token decode time of a batch of B equal requests
(B=1 by default), timed after a warm-up, set beside the roofline floor of the same step.

Per run: `LLM.generate` of B random token-id prompts of --input-len tokens, greedy, EOS ignored,
--output-len tokens each, prefix cache emptied first. Prefill is the time until every request has its
first token (RequestOutput.metrics: first arrival -> last first_token_time; a separate max_tokens=1
run where metrics are missing). Decode per token is (total - prefill) / (output_len - 1).

Roofline: a decode step reads the weights (lm_head in full, embedding rows only) plus the KV of B
sequences at the average decode context (input + output/2) - for a mixture of experts only the routed
experts the step reads (k per sparse layer at batch 1; `experts_read_per_layer`), for latent attention
the latent KV; floor = those bytes / mem_read_GBps and
MBU = bytes per step x steps/s / mem_read_GBps. Prefill MFU = the prefill's FLOPs (ModelCost.
prefill_flops_per_token: the lm_head once per prompt, causal attention) / prefill time / peak GFLOP/s
of the dtype. Bandwidth and FLOP/s come from --bandwidth/--flops, else the roofline cache, else one
measurement at the engine's thread count (then cached); neither ratio exceeds 1 (a rate above its
ceiling raises the ceiling: `mbu_ceiling_raised` / `mfu_ceiling_raised`). The engine's /metrics count
a step's bytes and FLOPs with the same arithmetic (metrics/step_cost.py). `plan_*` fields are `tokenmill
plan`'s capacity for the engine's KV budget, beside the pool it built.

--json-schema FILE constrains every request with that JSON schema (structured output, issue #24's
target: decode per token against the same run without it); the schema's output must be longer than
--output-len (bench/schemas/records.json is: 64 records at least), so that every run decodes the same
number of steps. The result adds the grammar's compile time (the first request's, off the step loop).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any

from tokenmill.bench.model_math import ModelCost, decode_floor, kv_capacity, max_requests
from tokenmill.bench.results import ResultSink, emit, gpu_pdl, loaded_weight_bytes, peak_rss_mb, require_positive, sig
from tokenmill.bench.roofline import Ceilings, add_ceiling_args, ceilings
from tokenmill.bench.spec_workload import run_dataset, spec_fields
from tokenmill.bench.workload import random_workload
from tokenmill.config import EngineArgs
from tokenmill.metrics.ceilings import utilization
from tokenmill.metrics.step_cost import engine_fields, model_cost


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1, help="untimed runs first (at most 16 output tokens each)")
    p.add_argument("--vocab-low", type=int, default=10)
    p.add_argument("--workload-seed", type=int, default=0)
    p.add_argument("--dataset", default=None, metavar="FILE.jsonl",
                   help="prompts from a JSONL file ({\"prompt\": text} a line; tools/spec_datasets.py writes "
                        "copy-heavy and Shakespeare-continuation ones) instead of random token ids: each run "
                        "generates --output-len tokens for every prompt, --batch-size at a time")
    p.add_argument("--json-schema", default=None, metavar="FILE",
                   help="constrain every request with this JSON schema (structured output); its output must be "
                        "longer than --output-len, e.g. bench/schemas/records.json")
    add_ceiling_args(p)
    EngineArgs.add_cli_args(p)


@dataclass
class RunTiming:
    total_s: float
    prefill_s: float


def _check(args: argparse.Namespace) -> None:
    require_positive(args, "input_len", "batch_size", "runs")
    if args.output_len < 2:
        raise ValueError("--output-len must be >= 2 (one prefill token plus at least one decode step)")
    if args.warmup < 0:
        raise ValueError("--warmup must be >= 0")


def _prefill_from_metrics(outs: list[Any]) -> float | None:
    metrics = [o.metrics for o in outs]
    if any(m is None or m.first_token_time is None for m in metrics):
        return None
    return max(m.first_token_time for m in metrics) - min(m.arrival_time for m in metrics)


def timed_runs(llm: Any, prompts: list[Any], params: Any, runs: int) -> tuple[list[RunTiming], str]:
    timings, source = [], "metrics"
    for _ in range(runs):
        llm.engine.reset_prefix_cache()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        total = time.perf_counter() - t0
        got = sum(len(o.outputs[0].token_ids) for o in outs)
        if got != len(prompts) * params.max_tokens:
            why = (": the --json-schema output ended first; give a schema whose output is longer than --output-len"
                   if params.structured_outputs is not None else "")
            raise ValueError(f"asked for {len(prompts) * params.max_tokens} output tokens, got {got}{why}")
        prefill = _prefill_from_metrics(outs)
        if prefill is None:  # no per-request metrics: time a one-token run instead
            source = "max_tokens=1 run"
            llm.engine.reset_prefix_cache()
            t0 = time.perf_counter()
            llm.generate(prompts, params.clone(max_tokens=1), use_tqdm=False)
            prefill = time.perf_counter() - t0
        timings.append(RunTiming(total, prefill))
    return timings, source


def roofline_fields(cost: ModelCost, roof: Ceilings, batch: int, context: int, prompt_tokens: int,
                    prefill_s: float, decode_step_s: float) -> dict[str, Any]:
    """MBU of the decode steps and MFU of the prefill against the ceilings (metrics/ceilings.utilization:
    a rate above its ceiling raises the ceiling, `*_ceiling_raised` says so), beside the floor."""
    nbytes = cost.decode_bytes(batch, context)
    prefill_flops = prompt_tokens * cost.prefill_flops_per_token(prompt_tokens // batch)
    achieved_gbps, prefill_gflops = nbytes / decode_step_s / 1e9, prefill_flops / prefill_s / 1e9
    out: dict[str, Any] = {
        "params": cost.params, "matmul_params": cost.matmul_params, "weight_bytes": cost.weight_bytes,
        "decode_weight_bytes": cost.decode_weight_bytes(batch),
        "kv_bytes_per_step": batch * context * cost.kv_bytes_per_token, "bytes_per_step": nbytes,
        "avg_context": context, "achieved_GBps": sig(achieved_gbps), "prefill_flops": sig(prefill_flops),
        "achieved_prefill_gflops": sig(prefill_gflops),
        "mem_read_GBps": roof.bandwidth_gbps, "peak_gflops": roof.gflops,
        "bandwidth_source": roof.bandwidth_source, "flops_source": roof.flops_source,
        "decode_floor_ms": None, "decode_memory_floor_ms": None, "decode_compute_floor_ms": None,
        "mbu": None, "prefill_mfu": None, "mbu_ceiling_raised": False, "mfu_ceiling_raised": False,
    }
    if cost.arch.moe is not None:
        out["experts_read_per_layer"] = sig(cost.experts_read(batch))
    if roof.bandwidth_gbps:
        u = utilization(achieved_gbps, roof.bandwidth_gbps)
        out.update(mbu=sig(u.ratio), mbu_ceiling_raised=u.raised)
        out["decode_memory_floor_ms"] = sig(nbytes / (roof.bandwidth_gbps * 1e9) * 1e3)
    if roof.gflops:
        u = utilization(prefill_gflops, roof.gflops)
        out.update(prefill_mfu=sig(u.ratio), mfu_ceiling_raised=u.raised)
    if roof.bandwidth_gbps and roof.gflops:
        floor = decode_floor(cost, batch, context, roof.bandwidth_gbps, roof.gflops)
        out["decode_compute_floor_ms"] = sig(floor.compute_s * 1e3)
        out["decode_floor_ms"] = sig(floor.floor_s * 1e3)
        out["decode_vs_floor"] = sig(decode_step_s / floor.floor_s)
    return out


def plan_fields(config: Any, cost: ModelCost, context: int, num_blocks: int) -> dict[str, Any]:
    """`tokenmill plan`'s capacity for this engine's KV budget beside the pool the engine built."""
    bs = config.cache.block_size
    blocks = config.cache.num_kv_blocks
    planned = blocks * bs if blocks is not None else kv_capacity(config.cache.kv_cache_bytes, cost, bs)
    return {"plan_kv_capacity_tokens": planned, "kv_capacity_tokens": num_blocks * bs,
            "plan_max_requests": max_requests(planned, context, bs),
            "max_requests": max_requests(num_blocks * bs, context, bs)}


def load_schema(path: str | None) -> dict[str, Any] | None:
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            schema = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"--json-schema {path!r}: cannot read a JSON schema: {e}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"--json-schema {path!r}: a JSON schema must be an object")
    return schema


def structured_fields(llm: Any, path: str | None, params: Any) -> dict[str, Any]:
    """The structured-output run's schema and its grammar's compile time (the first request's)."""
    if path is None or params.structured_outputs is None:
        return {"json_schema": None}
    from tokenmill.structured.grammar import grammar_key

    backend = llm.engine.core.scheduler.structured_output
    compile_s = backend.compile_seconds.get(grammar_key(params.structured_outputs, backend.disable_any_whitespace))
    config = llm.engine.config.structured_outputs
    return {"json_schema": os.path.basename(path), "grammar_backend": config.backend,
            "json_whitespace": ("none" if config.disable_any_whitespace
                                else "any" if config.max_json_whitespace is None else config.max_json_whitespace),
            "grammar_compile_s": None if compile_s is None else sig(compile_s)}


def run(args: argparse.Namespace) -> int:
    import torch

    from tokenmill.entrypoints.llm import LLM
    from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams

    _check(args)
    engine_args = EngineArgs.from_cli_args(args)
    if args.dataset is not None:
        return run_dataset(args, engine_args)
    t0 = time.perf_counter()
    llm = LLM(model=args.model, skip_tokenizer_init=True,
              **{k: v for k, v in vars(engine_args).items() if k != "model"})
    load_s = time.perf_counter() - t0
    config = llm.engine.config
    arch, b = config.model.arch, args.batch_size
    reqs = random_workload(b, str(args.input_len), str(args.output_len), args.vocab_low, arch.vocab_size,
                           args.workload_seed)
    prompts: list[Any] = [{"prompt_token_ids": r.prompt_token_ids} for r in reqs]
    schema = load_schema(args.json_schema)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True,
                            structured_outputs=None if schema is None else StructuredOutputsParams(json=schema))
    for _ in range(args.warmup):
        llm.engine.reset_prefix_cache()
        llm.generate(prompts, params.clone(max_tokens=min(16, args.output_len)), use_tqdm=False)
    stats0 = llm.engine.stats
    timings, prefill_source = timed_runs(llm, prompts, params, args.runs)
    stats1 = llm.engine.stats

    steps = args.output_len - 1
    prefill_s = statistics.median(t.prefill_s for t in timings)
    decode_s = statistics.median(t.total_s - t.prefill_s for t in timings)
    total_s = statistics.median(t.total_s for t in timings)
    step_s = decode_s / steps
    threads = torch.get_num_threads()
    device = config.device.device
    roof = ceilings(config.model.dtype, args.bandwidth, args.flops, threads if device == "cpu" else 1,
                    measure_missing=args.roofline, device=device)
    context = args.input_len + args.output_len // 2
    quant = config.model.quantization
    cost = model_cost(config)
    emit({
        "engine": "tokenmill", "bench": "latency", "model": args.model, "threads": threads,
        "dtype": config.model.dtype, "device": device, "attention_backend": config.attention_backend,
        "batch_size": b, "prompt_len": args.input_len, "gen": args.output_len, "runs": args.runs,
        "async_scheduling": config.scheduler.async_scheduling, "warmup": args.warmup, "prefill_s": round(prefill_s, 5),
        "prefill_tok_s": sig(b * args.input_len / prefill_s), "prefill_from": prefill_source,
        "decode_s": round(decode_s, 5), "decode_ms_per_tok": sig(step_s * 1e3),
        "decode_tok_s": sig(b / step_s), "total_s": round(total_s, 5),
        "prefill_s_runs": [round(t.prefill_s, 5) for t in timings],
        "decode_s_runs": [round(t.total_s - t.prefill_s, 5) for t in timings],
        "total_s_runs": [round(t.total_s, 5) for t in timings],
        **roofline_fields(cost, roof, b, context, b * args.input_len, prefill_s, step_s),
        **plan_fields(config, cost, context, llm.engine.core.num_blocks),
        **engine_fields(stats0.step, stats1.step, roof),
        "quantization": None if quant is None else quant.format, "weight_format": cost.quantization,
        "linear_weight_dtype": config.model.linear_weight_dtype,
        "pdl": gpu_pdl(config.device.device, config.attention_backend),
        "loaded_weight_bytes": loaded_weight_bytes(llm),
        "load_s": round(load_s, 2), "peak_rss_mb": round(peak_rss_mb(), 1), "loadavg": round(os.getloadavg()[0], 2),
        "kv_blocks": llm.engine.core.num_blocks, "block_size": config.cache.block_size,
        "kv_cache_dtype": config.cache.kv_cache_dtype, "kv_bytes_per_token": cost.kv_bytes_per_token,
        "max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
        **spec_fields(config, stats0, stats1),
        **structured_fields(llm, args.json_schema, params),
    }, ResultSink.from_args(args))
    return 0
