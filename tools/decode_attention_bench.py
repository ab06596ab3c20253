"""How fast the CPU paged-decode kernel reads the KV cache, in GB/s of K and V read.

Usage (from the repository root)::

    .venv/bin/python tools/decode_attention_bench.py [--threads 1] [--reps 7]

Three cases, the 100M model's attention shape (12 query heads, 4 kv heads, head size 64, blocks of
16 tokens) unless told otherwise:

- ``hot``: 8 sequences of 128-256 tokens, one layer, 32 passes (~1.4 MiB of KV, held in L2/L3): the kernel's own
  speed, with memory out of the way;
- ``scattered``: 256 sequences of 200-400 tokens over 8 layers (~1.6 GB), blocks at random places in
  the pool, as a long-running engine hands them out;
- ``contiguous``: the same, each sequence's blocks one after another.

``--kv-dtype int8`` times the quantized cache's kernel (``paged_attention_quant``) on int8 K/V with a
float32 scale per token and kv head, counting the scales in the bytes read.

Compare the figures with `tokenmill bench roofline`'s ``mem_read_GBps`` (a sequential read): the
gap between ``hot`` and that says whether the kernel is compute-bound, the gap between ``scattered`` and
``contiguous`` what scattered blocks cost. Medians of --reps timings.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from tokenmill.kernels import load_cpu_kernels
from tokenmill.worker.memory import zeros_lazily

# name: (sequences, longest context, layers, contiguous blocks, passes per timing)
CASES = {"hot": (8, 256, 1, False, 32), "scattered": (256, 400, 8, False, 1), "contiguous": (256, 400, 8, True, 1)}


def build(batch: int, context: int, layers: int, contiguous: bool, args: argparse.Namespace) -> dict[str, Any]:
    """Caches [2, blocks, bs, kv heads, head_dim] per layer, block tables, lengths in [context/2, context]."""
    gen = torch.Generator().manual_seed(0)
    bs = args.block_size
    per_seq = (context + bs - 1) // bs
    pool = batch * per_seq
    order = torch.arange(pool) if contiguous else torch.randperm(pool, generator=gen)
    shape = (2, pool, bs, args.kv_heads, args.head_dim)
    # in 2 MiB pages where the kernel has them, as the engine's KV pool is (tokenmill.worker.memory)
    if args.kv_dtype == "int8":
        caches = [(zeros_lazily(shape, torch.int8, torch.device("cpu")).copy_(
                       torch.randint(-127, 128, shape, dtype=torch.int8, generator=gen)),
                   torch.rand(shape[:4], generator=gen) / 64)
                  for _ in range(layers)]
    else:
        caches = [(zeros_lazily(shape, torch.bfloat16, torch.device("cpu")).copy_(torch.randn(*shape, generator=gen)),
                   None) for _ in range(layers)]
    return {
        "q": torch.randn(batch, args.heads, args.head_dim, generator=gen).bfloat16(),
        "caches": caches,
        "tables": order.to(torch.int32).view(batch, per_seq),
        "lens": torch.randint(max(1, context // 2), context + 1, (batch,), dtype=torch.int32, generator=gen),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-dtype", choices=("bf16", "int8"), default="bf16")
    args = p.parse_args()
    ops = load_cpu_kernels()
    if ops is None:
        raise SystemExit("the C++ CPU kernels could not be built here")
    torch.set_num_threads(args.threads)
    scale = args.head_dim ** -0.5
    for name, (batch, context, layers, contiguous, passes) in CASES.items():
        case = build(batch, context, layers, contiguous, args)
        per_token = args.kv_heads * (args.head_dim * 2 if args.kv_dtype == "bf16" else args.head_dim + 4)
        read = int(case["lens"].sum()) * per_token * 2 * layers * passes  # K and V (int8: with their scales)

        def run(case: dict[str, Any] = case, passes: int = passes) -> float:
            start = time.perf_counter()
            for cache, scales in case["caches"] * passes:
                if scales is None:
                    ops.paged_decode(case["q"], cache[0], cache[1], case["tables"], case["lens"], scale, 0)
                else:
                    ops.paged_attention_quant(case["q"], cache[0], cache[1], scales[0], scales[1], case["tables"],
                                              case["lens"], scale, 0)
            return time.perf_counter() - start

        run()
        seconds = statistics.median(run() for _ in range(args.reps))
        print(f"{name:11s} {batch:4d} seqs x {context // 2}-{context} tokens x {layers} layers x {passes} passes: "
              f"{read / 2**20:8.1f} MiB in {seconds * 1e3:7.2f} ms = {read / seconds / 1e9:5.1f} GB/s")


if __name__ == "__main__":
    main()
