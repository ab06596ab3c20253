"""Where an offline run's time goes: kernels (torch profiler) and the engine's Python stages.

Usage (from the repository root)::

    .venv/bin/python tools/profile_offline.py MODEL WORKLOAD.jsonl [--num N] [--threads 1]

WORKLOAD is a `make_workload.py` file, read as `bench throughput --dataset` reads it. One untimed run first
faults the KV pool in and warms everything up; the prefix cache is emptied, and the second run
is measured as `tokenmill bench throughput` measures its later runs (greedy, EOS ignored). Prints
the top kernels by self time under the torch profiler, then, from a third run without the
profiler, the wall time of each engine stage (stages nest: prepare + execute hold model.forward,
the fused decode calls and the sampling; core.step holds schedule and update_from_output).

The engine runs synchronously here unless --async-scheduling is given: the profiler records the ops
of the thread that started it, and with async scheduling the steps run on the worker thread, so
its kernel table would be empty. Synchronous steps run the same kernels.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from torch.profiler import ProfilerActivity, profile

from tokenmill import LLM
from tokenmill.bench.throughput import generate_inputs
from tokenmill.bench.workload import load_jsonl


def timed(totals: dict[str, float], obj: Any, name: str, label: str) -> None:
    """Wrap obj.name so that its wall time adds up under label."""
    fn: Callable[..., Any] = getattr(obj, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[label] += time.perf_counter() - start

    setattr(obj, name, wrapper)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("workload")
    p.add_argument("--num", type=int, default=256, help="requests from the start of the workload")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--top", type=int, default=16, help="kernels to list")
    p.add_argument("--async-scheduling", action="store_true",
                   help="run steps on the worker thread (the kernel table then misses them)")
    args = p.parse_args()

    prompts, params = generate_inputs(load_jsonl(args.workload)[: args.num], ignore_eos=True)
    llm = LLM(model=args.model, num_threads=args.threads, async_scheduling=args.async_scheduling)

    def run() -> tuple[float, int]:
        llm.engine.reset_prefix_cache()
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outs)

    run()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        wall, tokens = run()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    print(f"profiled run: {wall:.2f} s, {tokens / wall:.1f} output tok/s (profiler overhead included)")
    for e in events[: args.top]:
        print(f"  {e.key:40s} {e.self_cpu_time_total / 1e6:8.2f} s  {e.count:7d} calls")

    engine = llm.engine
    core, runner = engine.core, engine.core.executor.runner
    totals: dict[str, float] = defaultdict(float)
    stages = ((engine, "step", "LLMEngine.step"), (engine.output_processor, "process", "output processing"),
              (core, "step", "core.step"), (core.scheduler, "schedule", "schedule"),
              (core.scheduler, "update_from_output", "update_from_output"),
              (runner, "prepare", "prepare (inputs)"), (runner, "execute", "execute"),
              (runner.model, "forward", "model.forward"), (runner, "_sample", "sampling (lm_head included)"),
              (runner.model, "compute_logits", "lm_head"))
    if runner.fused_decode is not None:
        stages += ((runner.fused_decode, "greedy", "fused decode_greedy"),
                   (runner.fused_decode, "forward", "fused decode_layers"))
    for obj, name, label in stages:
        timed(totals, obj, name, label)
    wall, tokens = run()
    print(f"stage run: {wall:.2f} s, {tokens / wall:.1f} output tok/s")
    for label, seconds in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"  {label:30s} {seconds:8.2f} s")


if __name__ == "__main__":
    main()
