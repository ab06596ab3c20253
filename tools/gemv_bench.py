"""The decode GEMV (kernels/triton/gemv.py) against cuBLAS (F.linear) on a GPU, over a model's projections:

    python3 tools/gemv_bench.py [--hidden 2048 --inter 5632 --heads 32 --kv-heads 4 --vocab 32000]
                                [--rows 1,2,4,8] [--sweep] [--flush-mib 256]

Each timing is a CUDA graph of calls that cycle over enough copies of the weight (`--flush-mib` or more together)
that no call finds its weight in L2, replayed several times; the median replay over its calls gives us per
call and `GBps` the weight bytes read per second. `--sweep` also times every (BLOCK_N, BLOCK_K, num_warps) of
a small grid at each shape and row count (SWEEP_ONE_ROW, SWEEP_ROWS). Prints one JSON line per timing
(`bench`: "gemv")."""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from itertools import product

import torch
import torch.nn.functional as F

from tokenmill.kernels.triton.gemv import gemv, gemv_config, gemv_dot

# (BLOCK_N, BLOCK_K, num_warps) that --sweep times: at one row, and at several
SWEEP_ONE_ROW = list(product((1, 2, 4), (512, 1024, 2048), (2, 4, 8)))
SWEEP_ROWS = list(product((1, 2, 4), (256, 512, 1024), (4,)))
DOT_DEFAULT = (32, 256, 4)  # gemv_dot's, at 2 rows or more
SWEEP_DOT = list(product((16, 32, 64), (128, 256, 512), (4,)))


def time_calls(calls: list[Callable[[], object]], reps: int = 5) -> float:
    """Median microseconds per call of `calls`, run in order inside one CUDA graph (on the CPU, to try the
    script under TRITON_INTERPRET=1 with tiny shapes: in a loop)."""
    for c in calls[:2]:  # compiles, warms up
        c()
    if not torch.cuda.is_available():
        t = time.perf_counter()
        for c in calls:
            c()
        return (time.perf_counter() - t) * 1e6 / len(calls)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    return statistics.median(times)


def bench_shape(weights: list[torch.Tensor], rows: int, gated: bool,
                sweep: bool) -> Iterator[tuple[str, tuple[int, int, int] | None, float]]:
    """(kernel, config, us per call) of cuBLAS, and of the GEMV (and its gated form, for a down projection)
    at its default config and with `sweep` at every other of SWEEP_ONE_ROW or SWEEP_ROWS, for `rows` rows; at
    two rows or more also `gemv_dot` (tile products) at DOT_DEFAULT and with `sweep` SWEEP_DOT."""
    n, k = weights[0].shape
    x = torch.randn(rows, 2 * k if gated else k, device=weights[0].device, dtype=weights[0].dtype)
    xs = x[:, :k].contiguous()
    yield "cublas", None, time_calls([functools.partial(F.linear, xs, w) for w in weights])
    default = gemv_config(rows, n, k)
    configs = [default] + [c for c in (SWEEP_ONE_ROW if rows == 1 else SWEEP_ROWS) if sweep and c != default]
    for config in configs:
        yield "triton", config, time_calls([functools.partial(gemv, xs, w, config=config) for w in weights])
        if gated:
            yield "triton-gated", config, time_calls([functools.partial(gemv, x, w, gated=True, config=config)
                                                      for w in weights])
    dot_configs = [] if rows == 1 else [DOT_DEFAULT] + [c for c in SWEEP_DOT if sweep and c != DOT_DEFAULT]
    for config in dot_configs:
        yield "triton-dot", config, time_calls([functools.partial(gemv_dot, xs, w, config=config) for w in weights])


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=5632)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--rows", default="1,2,4,8")
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--flush-mib", type=int, default=256, help="the weight copies' least total size (L2: 50 MiB)")
    args = p.parse_args(argv)
    h, head_dim = args.hidden, args.hidden // args.heads
    shapes = {"qkv": (h + 2 * args.kv_heads * head_dim, h), "o": (h, h), "gate_up": (2 * args.inter, h),
              "down": (h, args.inter), "lm_head": (args.vocab, h)}
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device_name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    for name, (n, k) in shapes.items():
        copies = max(2, -(-(args.flush_mib << 20) // (n * k * 2)))
        weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
        for rows in [int(r) for r in args.rows.split(",")]:
            for kernel, config, us in bench_shape(weights, rows, name == "down", args.sweep):
                print(json.dumps({"bench": "gemv", "device": device_name, "shape": name, "n": n, "k": k, "rows": rows,
                                  "kernel": kernel, "config": config, "us": round(us, 2),
                                  "GBps": round(n * k * 2 / us / 1e3, 1)}), flush=True)
        del weights
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
