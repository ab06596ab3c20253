"""The GPU path's two measurements that `tokenmill bench` has no command for (tools/gpu_check.sh runs both):

    python3 tools/gpu_bench.py hf MODEL --batch-sizes 64,256 [--num-prompts 256 --input-len 32:512 --output-len 32:256]
    python3 tools/gpu_bench.py profile MODEL [--batch 64 --steps 32 --table FILE --trace FILE --launch-ahead off
                                             --gemv off --gated on --gemv-config N,K,W
                                             --no-profiler --replay N]
                                             [engine args: --attention-backend cuda ...]

`hf`: transformers `generate` on the GPU over `tokenmill bench throughput`'s random workload (same seed, same
prompts and max_tokens): static batches in workload order, left-padded, greedy, EOS ignored, each batch run to
its longest max_tokens; one warm-up batch, then one timed run per batch size. `output_tok_s` counts only each
request's own max_tokens, as `bench throughput` does.

`profile`: `batch` requests of 128-token prompts decoding `steps` tokens under the torch profiler (CUDA
kernels are traced whichever thread launches them); the decode window's wall time per step against the
time some GPU kernel was running (the union of kernel intervals), the rest being the GPU idle between
kernels (CPU work: scheduling, input preparation, launches, host syncs). `--replay N` adds the GPU's time for
the step's model forward alone (its CUDA graph replayed N times back to back), so that the step time's host
share shows without the profiler. Prints one JSON line each."""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from typing import Any

import torch

from tokenmill.bench.results import gpu_pdl
from tokenmill.bench.workload import random_workload
from tokenmill.config import EngineArgs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # (the CPU only to try the script on a tiny model)


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def hf(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).to(DEVICE).eval()
    reqs = random_workload(args.num_prompts, args.input_len, args.output_len, 10, model.config.vocab_size,
                           0, 0)
    useful = sum(r.max_tokens for r in reqs)

    def run(batch: list[Any], cap: int | None = None) -> None:
        longest = max(len(r.prompt_token_ids or []) for r in batch)
        ids = torch.zeros(len(batch), longest, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(batch):  # left padding
            ids[i, longest - len(r.prompt_token_ids or []):] = torch.tensor(r.prompt_token_ids or [])
            mask[i, longest - len(r.prompt_token_ids or []):] = 1
        new = cap or max(r.max_tokens for r in batch)
        model.generate(input_ids=ids.to(DEVICE), attention_mask=mask.to(DEVICE), max_new_tokens=new,
                       min_new_tokens=new, do_sample=False, pad_token_id=0)

    per_batch = {}
    with torch.inference_mode():
        run(reqs[:8], cap=4)
        for bs in (int(b) for b in args.batch_sizes.split(",")):
            sync()
            t = time.perf_counter()
            for i in range(0, len(reqs), bs):
                run(reqs[i:i + bs])
            sync()
            wall = time.perf_counter() - t
            per_batch[bs] = {"wall_s": round(wall, 3), "output_tok_s": round(useful / wall, 1)}
            print(json.dumps({"engine": "hf-generate", "partial": True, "batch_size": bs, **per_batch[bs]}),
                  flush=True)  # each batch size as it ends, in case a time limit stops the next
    best = max(per_batch, key=lambda b: per_batch[b]["output_tok_s"])
    return {"engine": "hf-generate", "model": args.model, "requests": len(reqs), "output_tokens": useful,
            "per_batch_size": per_batch, "best_batch_size": best, **per_batch[best],
            "device": device_name()}


def device_name() -> str:
    return torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"


def profile(args: argparse.Namespace, engine_args: EngineArgs) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from tokenmill import LLM, SamplingParams

    if args.gemv == "off":  # cuBLAS for decode batches too (the A/B of kernels/triton/gemv.py), before capture
        import tokenmill.worker.worker as worker_module

        worker_module.use_triton_gemv = lambda model, ops: 0
    if args.gated == "on":  # SiLU-and-mul in the down projection's GEMV (LinearBase.gated_forward), not offered
        from tokenmill.kernels.triton.gemv import TritonGemv, gated_gemv  # by default

        TritonGemv.gated_gemv = staticmethod(gated_gemv)
    if args.gemv_config:  # the GEMV's tiles for every shape (BLOCK_N, BLOCK_K, num_warps), for a sweep in the engine
        import tokenmill.kernels.triton.gemv as gemv_module

        tiles = tuple(int(v) for v in args.gemv_config.split(","))
        gemv_module.gemv_config = lambda rows, n, k: tiles  # type: ignore[assignment]
    llm = LLM(model=args.model, **{k: v for k, v in vars(engine_args).items() if k != "model"})
    runner = llm.engine.core.executor.worker.model_runner
    if args.launch_ahead == "off":  # the worker thread runs every step (the A/B of ModelRunner.launch)
        runner.launch_ahead = False
    prompts = [{"prompt_token_ids": r.prompt_token_ids}
               for r in random_workload(args.batch, "128", "1", 10, llm.engine.config.model.arch.vocab_size, 1, 0)]
    params = SamplingParams(temperature=0.0, max_tokens=args.steps, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up: compiles kernels, captures graphs
    llm.engine.reset_prefix_cache()
    steps0 = llm.engine.stats.num_steps
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE == "cuda" else [])
    launched0 = runner.launched
    with torch_profile(activities=activities) if args.profiler else contextlib.nullcontext() as prof:
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        sync()
        wall_us = (time.perf_counter() - t) * 1e6
    steps = llm.engine.stats.num_steps - steps0
    config = llm.engine.config
    replay_ms = graph_replay_ms(runner, args.batch, args.replay) if args.replay else None
    common = {"model": args.model, "attention_backend": config.attention_backend,
              "enforce_eager": config.device.enforce_eager, "async_scheduling": config.scheduler.async_scheduling,
              "launch_ahead": runner.launch_ahead, "launched_steps": runner.launched - launched0, "gemv": args.gemv,
              "gated": args.gated, "pdl": gpu_pdl(DEVICE, config.attention_backend), "gemv_config": args.gemv_config,
              "batch": args.batch, "steps": steps, "wall_ms_per_step": round(wall_us / steps / 1e3, 3),
              "graph_replay_ms": replay_ms,
              "device": device_name()}
    if prof is None:
        return {"bench": "gpu-step-time", **common}
    if args.table:  # the host-side ops that took the most time, for finding the CPU's share of a step
        with open(args.table, "w") as f:
            f.write(prof.key_averages().table(sort_by=args.table_sort, row_limit=60, max_name_column_width=80))
    if args.trace:
        prof.export_chrome_trace(args.trace)
    kernels = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA)
    busy, end = 0.0, -1.0
    for s, e in kernels:  # the union of kernel intervals
        if e > end:
            busy += e - max(s, end)
            end = e
    return {"bench": "gpu-step-split", **common, "kernels": len(kernels),
            "gpu_busy_ms_per_step": round(busy / steps / 1e3, 3),
            "gpu_idle_ms_per_step": round((wall_us - busy) / steps / 1e3, 3),
            "gpu_busy_fraction": round(busy / wall_us, 3),
            "median_kernel_us": round(statistics.median(e - s for s, e in kernels), 2) if kernels else None}


def graph_replay_ms(runner: Any, batch: int, n: int) -> float | None:
    """The GPU's time for one decode step's model forward alone: the batch's CUDA graph replayed n times back
    to back (no host work between), over the inputs of the last step it ran. None without graphs."""
    graphs = getattr(runner, "graphs", None)
    if graphs is None or DEVICE != "cuda":
        return None
    from tokenmill.worker.cuda_graphs import padded_size

    size = padded_size(batch, graphs.sizes)
    if size not in graphs.graphs:
        return None
    graph = graphs.graphs[size][0]
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        graph.replay()
    end.record()
    end.synchronize()
    return round(start.elapsed_time(end) / n, 4)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    h = sub.add_parser("hf")
    h.add_argument("model")
    h.add_argument("--batch-sizes", default="64,256")
    h.add_argument("--num-prompts", type=int, default=256)
    h.add_argument("--input-len", default="32:512")
    h.add_argument("--output-len", default="32:256")
    pr = sub.add_parser("profile")
    pr.add_argument("--batch", type=int, default=64)
    pr.add_argument("--steps", type=int, default=32)
    pr.add_argument("--launch-ahead", choices=("on", "off"), default="on",
                    help="off: every step on the worker thread (ModelRunner.launch_ahead), for an A/B")
    pr.add_argument("--no-profiler", dest="profiler", action="store_false",
                    help="time the decode window only (gpu-step-time), without the profiler's overhead")
    pr.add_argument("--table", help="write the profiler's op table (by self CPU time) to this file")
    pr.add_argument("--trace", help="write the profiler's Chrome trace to this file")
    pr.add_argument("--table-sort", default="self_cpu_time_total",
                    help="the table's order: self_cpu_time_total, or self_device_time_total for the GPU's kernels")
    pr.add_argument("--replay", type=int, default=0, metavar="N",
                    help="also time the batch's CUDA graph replayed N times back to back (graph_replay_ms)")
    pr.add_argument("--gemv", choices=("on", "off"), default="on",
                    help="off: decode batches through cuBLAS, not the Triton GEMV (triton backend), for an A/B")
    pr.add_argument("--gemv-config", metavar="BLOCK_N,BLOCK_K,WARPS",
                    help="the Triton GEMV's tiles for every shape instead of gemv_config's, for a sweep")
    pr.add_argument("--gated", choices=("on", "off"), default="off",
                    help="on: SiLU-and-mul in the down projection's GEMV, not as its own kernel before it (the "
                         "layers' default), for an A/B")
    EngineArgs.add_cli_args(pr)
    pr.add_argument("model")
    args = p.parse_args(argv)
    result = hf(args) if args.cmd == "hf" else profile(args, EngineArgs.from_cli_args(args))
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
