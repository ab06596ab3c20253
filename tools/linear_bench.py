"""tokenmill's packed kernel (ops.packed_gemv) against oneDNN's on the same packed weights, in GFLOP/s.

Usage (from the repository root)::

    .venv/bin/python tools/linear_bench.py [--threads 1] [--rows 16,64,128,256,2048] [--reps 5]

The projections of the 100M model (hidden 768, intermediate 2048, 12 heads / 4 kv heads of 64,
vocabulary 32000) unless --hidden/--intermediate/--heads/--kv-heads/--vocab say otherwise. Each
timing runs through enough copies of the weight (~200 MB) that every call finds its weight out of
cache, as a model's step does. Medians of --reps timings, the two kernels interleaved.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tokenmill.kernels import load_cpu_kernels


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rows", default="16,64,128,256,2048")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--vocab", type=int, default=32000)
    args = p.parse_args()
    ops = load_cpu_kernels()
    if ops is None or not ops.has_packed_gemv():
        raise SystemExit("tokenmill's packed kernel is not built here (no C++ compiler or no AVX512-BF16)")
    torch.set_num_threads(args.threads)
    h = args.hidden
    shapes = {"qkv": ((args.heads + 2 * args.kv_heads) * args.head_dim, h), "o": (h, args.heads * args.head_dim),
              "gate_up": (2 * args.intermediate, h), "down": (h, args.intermediate), "lm_head": (args.vocab, h)}
    print(f"{'shape':8s} {'rows':>5s} {'oneDNN':>7s} {'tokenmill':>9s}  (GFLOP/s, {args.threads} thread(s))")
    for name, (n, k) in shapes.items():
        copies = max(2, int(200e6 / (n * k * 2)))
        weights = [torch.ops.mkldnn._reorder_linear_weight(torch.randn(n, k).bfloat16(), 1) for _ in range(copies)]
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k).bfloat16()
            kernels = {
                "onednn": lambda w, x=x: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
                "tokenmill": lambda w, x=x: ops.packed_gemv(x, w, None),
            }
            times: dict[str, list[float]] = {name: [] for name in kernels}
            for _ in range(args.reps):
                for kname, fn in kernels.items():
                    start = time.perf_counter()
                    for w in weights:
                        fn(w)
                    times[kname].append((time.perf_counter() - start) / copies)
            flops = 2 * rows * n * k
            rate = {kname: flops / statistics.median(t) / 1e9 for kname, t in times.items()}
            print(f"{name:8s} {rows:5d} {rate['onednn']:7.0f} {rate['tokenmill']:9.0f}")


if __name__ == "__main__":
    main()
