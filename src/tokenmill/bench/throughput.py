"""`tokenmill bench throughput`: offline generation of a whole workload at once, timed after a
warm-up, the prefix cache emptied before each run; JSON with tok/s, peak RSS, the most KV blocks in
use at once, the KV cache's dtype, bytes per token and how many of the workload's longest sequences
(prompt + output) its pool holds at once, and MBU/MFU estimates.

The estimates divide the least work the run needs by its median wall time and this machine's ceilings
(`tokenmill bench roofline`, cached; neither ratio exceeds 1: a rate above its ceiling raises it, and
`*_ceiling_raised` says so):
  MFU: the FLOPs of every request with nothing cached (ModelCost.request_flops) / peak FLOP/s of the dtype.
  MBU: the bytes the steps must move at the least (the matmul weights once per step, as stored
       (ModelCost.matmul_weight_bytes), each request's KV
       as ModelCost.request_kv_bytes counts it) / memory read bandwidth.
A large batch is compute-bound, so its MFU is the telling figure; batch-1 decode's is MBU (`bench latency`)."""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from tokenmill.bench.model_math import ModelCost
from tokenmill.bench.results import ResultSink, emit, gpu_pdl, loaded_weight_bytes, peak_rss_mb, require_positive, sig
from tokenmill.bench.roofline import Ceilings, add_ceiling_args, ceilings, probe_peak
from tokenmill.bench.spec_workload import spec_fields
from tokenmill.bench.workload import BenchRequest, load_jsonl, random_workload
from tokenmill.config import EngineArgs
from tokenmill.metrics.ceilings import utilization
from tokenmill.metrics.step_cost import engine_fields, model_cost


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True)
    p.add_argument("--dataset", help="JSONL of {prompt|prompt_token_ids, max_tokens}; else random prompts")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", default="32:512", help="A or A:B tokens (random workload)")
    p.add_argument("--output-len", default="32:256", help="C or C:D tokens (random workload)")
    p.add_argument("--vocab-low", type=int, default=10)
    p.add_argument("--vocab-high", type=int, default=None, help="default: the model's vocab size")
    p.add_argument("--shared-prefix-len", type=int, default=0)
    p.add_argument("--workload-seed", type=int, default=0)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false")
    p.add_argument("--no-detokenize", dest="detokenize", action="store_false")
    p.add_argument("--no-host-probe", dest="host_probe", action="store_false",
                   help="skip timing the peak FMA loop at the run's threads before and after the runs (CPU)")
    add_ceiling_args(p)
    EngineArgs.add_cli_args(p)


def workload(args: argparse.Namespace, vocab: int) -> list[BenchRequest]:
    if args.dataset:
        return load_jsonl(args.dataset)
    return random_workload(args.num_prompts, args.input_len, args.output_len, args.vocab_low,
                           args.vocab_high or vocab, args.workload_seed, args.shared_prefix_len)


def generate_inputs(reqs: list[BenchRequest], ignore_eos: bool) -> tuple[list[Any], list[Any]]:
    """LLM.generate's prompts and greedy SamplingParams (each request's own max_tokens) for a workload."""
    from tokenmill.sampling_params import SamplingParams

    prompts: list[Any] = [{"prompt_token_ids": r.prompt_token_ids} if r.prompt_token_ids else r.prompt
                          for r in reqs]
    params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=ignore_eos) for r in reqs]
    return prompts, params


def estimates(cost: ModelCost, lens: list[tuple[int, int]], steps: float, wall_s: float,
              roof: Ceilings) -> dict[str, Any]:
    """MFU and MBU of a run: `lens` holds each request's (prompt, output) tokens (see the module's doc)."""
    flops = sum(cost.request_flops(p, o) for p, o in lens)
    nbytes = steps * cost.matmul_weight_bytes + sum(cost.request_kv_bytes(p, o) for p, o in lens)
    out: dict[str, Any] = {
        "flops": sig(flops), "bytes": sig(nbytes), "achieved_gflops": sig(flops / wall_s / 1e9),
        "achieved_GBps": sig(nbytes / wall_s / 1e9), "mem_read_GBps": roof.bandwidth_gbps,
        "peak_gflops": roof.gflops, "bandwidth_source": roof.bandwidth_source, "flops_source": roof.flops_source,
        "mfu": None, "mbu": None, "mfu_ceiling_raised": False, "mbu_ceiling_raised": False,
    }
    if roof.gflops:
        u = utilization(flops / wall_s / 1e9, roof.gflops)
        out.update(mfu=sig(u.ratio), mfu_ceiling_raised=u.raised)
    if roof.bandwidth_gbps:
        u = utilization(nbytes / wall_s / 1e9, roof.bandwidth_gbps)
        out.update(mbu=sig(u.ratio), mbu_ceiling_raised=u.raised)
    return out


def run(args: argparse.Namespace) -> int:
    import torch

    from tokenmill.entrypoints.llm import LLM

    require_positive(args, "runs", "num_prompts")
    engine_args = EngineArgs.from_cli_args(args)
    t0 = time.perf_counter()
    llm = LLM(model=args.model, skip_tokenizer_init=not args.detokenize,
              **{k: v for k, v in vars(engine_args).items() if k != "model"})
    load_s = time.perf_counter() - t0
    config = llm.engine.config
    reqs = workload(args, config.model.arch.vocab_size)
    prompts, params = generate_inputs(reqs, args.ignore_eos)
    llm.generate(prompts[:16], [p.clone(max_tokens=min(16, p.max_tokens or 16)) for p in params[:16]],
                 use_tqdm=False)
    threads = torch.get_num_threads()
    device = config.device.device
    probe = args.host_probe and device == "cpu"
    host_before = probe_peak(threads) if probe else None
    walls, steps, outs = [], [], []
    stats0 = llm.engine.stats
    for _ in range(args.runs):
        llm.engine.reset_prefix_cache()
        steps0 = llm.engine.stats.num_steps
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        walls.append(time.perf_counter() - t)
        steps.append(llm.engine.stats.num_steps - steps0)
    host_after = probe_peak(threads) if probe else None
    wall, step_count = statistics.median(walls), statistics.median(steps)
    lens = [(len(o.prompt_token_ids), len(o.outputs[0].token_ids)) for o in outs]  # the last run's
    quant = config.model.quantization
    cost = model_cost(config)
    bs, blocks = config.cache.block_size, llm.engine.core.num_blocks
    seq_len = max(p + r.max_tokens for (p, _), r in zip(lens, reqs, strict=True))
    prompt_tokens, output_tokens = sum(p for p, _ in lens), sum(o for _, o in lens)
    roof = ceilings(config.model.dtype, args.bandwidth, args.flops, threads if device == "cpu" else 1,
                    measure_missing=args.roofline, device=device)
    emit({
        "engine": "tokenmill", "bench": "throughput", "model": args.model,
        "threads": threads, "dtype": config.model.dtype, "device": config.device.device,
        "attention_backend": config.attention_backend, "requests": len(reqs),
        "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
        "wall_s": round(wall, 3), "wall_s_runs": [round(w, 3) for w in walls], "runs": args.runs,
        "requests_per_s": round(len(reqs) / wall, 3), "output_tok_s": round(output_tokens / wall, 1),
        "total_tok_s": round((prompt_tokens + output_tokens) / wall, 1), "load_s": round(load_s, 2),
        "peak_rss_mb": round(peak_rss_mb(), 1), "kv_blocks": llm.engine.core.num_blocks,
        "kv_blocks_used_peak": llm.engine.stats.peak_used_blocks, "steps": step_count, "steps_runs": steps,
        **estimates(cost, lens, step_count, wall, roof),
        "host_peak_gflops_before": host_before, "host_peak_gflops_after": host_after,
        **engine_fields(stats0.step, llm.engine.stats.step, roof),
        "kv_cache_dtype": config.cache.kv_cache_dtype, "kv_bytes_per_token": cost.kv_bytes_per_token,
        "kv_seq_len": seq_len, "kv_seqs_fit": blocks // -(-seq_len // bs),
        "quantization": None if quant is None else quant.format, "weight_format": cost.quantization,
        "linear_weight_dtype": config.model.linear_weight_dtype,
        "pdl": gpu_pdl(config.device.device, config.attention_backend),
        "weight_bytes": cost.weight_bytes, "loaded_weight_bytes": loaded_weight_bytes(llm),
        "block_size": config.cache.block_size, "max_num_seqs": config.scheduler.max_num_seqs,
        "max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
        "prefix_caching": config.cache.enable_prefix_caching,
        "async_scheduling": config.scheduler.async_scheduling, "detokenize": args.detokenize,
        "ignore_eos": args.ignore_eos, **spec_fields(config, stats0, llm.engine.stats),
    }, ResultSink.from_args(args))
    return 0
