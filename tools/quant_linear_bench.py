"""The quantized linear kernels (kernels/cpu/linear/quantized.cpp) against the bf16 ones on the same
shapes: at decode's few rows the weight bytes each reads per second (set it beside `tokenmill bench
roofline`'s mem_read_GBps), at prefill's many rows GFLOP/s (W8A8's VNNI products against oneDNN's bf16).

Usage (from the repository root)::

    .venv/bin/python tools/quant_linear_bench.py [--threads 1] [--rows 1,4,256] [--reps 5] \\
        [--schemes bf16,int8,int4,w8a8] [--group 128]

The projections of the 1.1B Llama (hidden 2048, intermediate 5632, 32 heads / 4 kv heads of 64) unless
--hidden/--intermediate/--heads/--kv-heads say otherwise. bf16 runs tokenmill's packed GEMV where it
takes the rows, oneDNN's packed linear beyond, as PackedLinear does; int8/int4 take their kernels up to
16 rows (the layers run the torch reference beyond, so larger row counts are skipped). Each timing runs
through enough copies of the weight (~300 MB) that every call finds its weight out of cache, as a
model's step does (over 16 rows, two copies: those calls are bound by arithmetic). Medians of --reps
timings, the schemes interleaved.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from tokenmill.kernels import load_cpu_kernels
from tokenmill.layers.quantization import KERNEL_MAX_ROWS, onednn_int8_product
from tokenmill.layers.quantization import reference as ref


def _kernel(ops: Any, scheme: str, w: torch.Tensor, group: int) -> tuple[Callable[[torch.Tensor], Any], int]:
    """A call x -> y on one copy of this weight in the scheme's layout, and that copy's bytes."""
    n, k = w.shape
    if scheme == "bf16":
        packed = torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), 1)
        max_rows = int(ops.packed_gemv_max_rows(k))

        def bf16(x: torch.Tensor) -> Any:
            if x.shape[0] <= max_rows:
                return ops.packed_gemv(x, packed, None)
            return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        return bf16, n * k * 2
    if scheme == "int8":
        q, scale = ref.rtn_int8(w)
        wsum = ref.weight_sum(q)
        return (lambda x: ops.int8_linear(x, q, scale, wsum, None)), q.numel() + scale.numel() * 8
    if scheme == "w8a8":
        q, scale = ref.rtn_int8(w)
        padded, wsum = ref.w8a8_layout(q)
        return (lambda x: ops.w8a8_linear(x, padded, scale, wsum, k, None)), padded.numel() + scale.numel() * 8
    if scheme == "w8a8-onednn":  # oneDNN's int8 matmul on its packed int8 weight, per-token scales after
        q, scale = ref.rtn_int8(w)
        packed8 = torch.ops.onednn.qlinear_prepack(q, None)
        zeros = torch.zeros(n, dtype=torch.int64)

        def onednn_int8(x: torch.Tensor) -> Any:
            xq, xs = ops.quantize_rows_uint8(x.contiguous())
            return ops.scale_rows(onednn_int8_product(xq, packed8, scale, zeros), xs, None, x.dtype)
        return onednn_int8, q.numel() + scale.numel() * 4
    q4, s4, z4 = ref.rtn_int4(w, group, False)
    packed4 = ref.pack_int4(q4)
    z4 = z4.new_empty(0)  # symmetric: no zero points, as the layers keep them
    return ((lambda x: ops.int4_linear(x, packed4, s4, z4, k, group, None)), packed4.numel() + s4.numel() * 4)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rows", default="1,4,256")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--schemes", default="bf16,int8,int4,w8a8")
    p.add_argument("--group", type=int, default=128)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    args = p.parse_args()
    ops = load_cpu_kernels()
    if ops is None or not ops.has_quantized_linear() or not ops.has_packed_gemv():
        raise SystemExit("the quantized and packed kernels are not built here (no compiler, AVX-512 VNNI or BF16)")
    torch.set_num_threads(args.threads)
    h = args.hidden
    shapes = {"qkv": ((args.heads + 2 * args.kv_heads) * args.head_dim, h), "o": (h, args.heads * args.head_dim),
              "gate_up": (2 * args.intermediate, h), "down": (h, args.intermediate)}
    schemes = args.schemes.split(",")
    print(f"{args.threads} thread(s); GB/s of weight bytes read, and GFLOP/s")
    print(f"{'shape':8s} {'rows':>5s} " + " ".join(f"{s + ' GB/s':>10s} {'GFLOP/s':>8s}" for s in schemes))
    for name, (n, k) in shapes.items():
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(n, k, generator=gen) * 0.02
        copies = max(2, int(300e6 / (n * k)))
        calls: dict[str, list[Callable[[torch.Tensor], Any]]] = {}
        nbytes: dict[str, int] = {}
        for s in schemes:
            made = [_kernel(ops, s, w, args.group) for _ in range(copies if s != "bf16" else max(2, copies // 2))]
            calls[s] = [fn for fn, _ in made]
            nbytes[s] = made[0][1]
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k, generator=gen).bfloat16()
            times: dict[str, list[float]] = {s: [] for s in schemes}
            for _ in range(args.reps):
                for s in schemes:
                    if s in ("int8", "int4") and rows > KERNEL_MAX_ROWS:
                        continue
                    use = calls[s] if rows <= KERNEL_MAX_ROWS else calls[s][:2]  # compute-bound: cache matters less
                    start = time.perf_counter()
                    for fn in use:
                        fn(x)
                    times[s].append((time.perf_counter() - start) / len(use))
            cols = []
            for s in schemes:
                if not times[s]:
                    cols.append(f"{'-':>10s} {'-':>8s}")
                    continue
                t = statistics.median(times[s])
                cols.append(f"{nbytes[s] / t / 1e9:10.1f} {2 * rows * n * k / t / 1e9:8.1f}")
            print(f"{name:8s} {rows:5d} " + " ".join(cols), flush=True)


if __name__ == "__main__":
    main()
