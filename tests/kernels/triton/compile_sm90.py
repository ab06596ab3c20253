"""Compiles the Triton kernels for an H100 (sm_90) to PTX and machine code with no GPU present: the compiler
checks what Triton's interpreter does not (globals that are not constexpr, types that do not unify, tile
shapes tl.dot refuses). Run in a process without TRITON_INTERPRET (test_compile.py does); prints one line a
kernel and exits 1 if any failed."""

from __future__ import annotations

import sys
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from tokenmill.kernels.triton import elementwise as ew
from tokenmill.kernels.triton import gemv as gv
from tokenmill.kernels.triton import paged_attention as pa

TARGET = GPUTarget("cuda", 90, 32)
F32 = "fp32"


def compile_one(name: str, fn: Any, types: dict[str, str], consts: dict[str, Any], num_warps: int = 4) -> bool:
    names = fn.arg_names
    signature = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
    try:
        src = ASTSource(fn=fn, signature=signature, constexprs={(names.index(k),): v for k, v in consts.items()})
        triton.compile(src, target=TARGET, options={"num_warps": num_warps})
    except Exception as e:  # the compiler's message is the point
        print(f"FAIL {name}: {type(e).__name__}: {e}")
        return False
    print(f"OK {name}")
    return True


def attention(dt: str, cache_dt: str, features: bool, direct: bool = False) -> list[bool]:
    types = dict(q_ptr="*" + dt, kc_ptr="*" + cache_dt, vc_ptr="*" + cache_dt, ks_ptr="*fp32", vs_ptr="*fp32",
                 tables_ptr="*i32", lens_ptr="*i32", part_out_ptr="*fp32", part_lse_ptr="*fp32", out_ptr="*" + dt,
                 scale=F32, softcap=F32, starts_ptr="*i32", tile_seq_ptr="*i32", tile_q0_ptr="*i32")
    common = dict(GROUP=8, HEAD_DIM=64, BLOCK_D=64, BLOCK_SIZE=16, TILE_N=64, QUANT=cache_dt in ("i8", "fp8e4nv"),
                  SOFTCAP=features, WINDOW=features, DOT_F32=dt == "fp32", PDL=features)
    tag = f"{dt}/{cache_dt}{' window softcap' if features else ''}"
    return [compile_one(f"decode {tag}", pa._decode_split_kernel, types, dict(common, BLOCK_H=16, DIRECT=direct)),
            compile_one(f"prefill {tag}", pa._prefill_kernel, types, dict(common, G_PAD=8, BLOCK_Q=16), num_warps=8)]


def main() -> int:
    bf = "*bf16"
    # every branch once: windows and soft-capping; one split written directly; float32 (IEEE products); int8
    ok = attention("bf16", "bf16", True) + attention("fp32", "fp32", False, direct=True)
    ok += attention("bf16", "i8", False)
    ok += [
        compile_one("reduce", pa._decode_reduce_kernel, dict(part_out_ptr="*fp32", part_lse_ptr="*fp32",
                                                             lens_ptr="*i32", out_ptr=bf),
                    dict(HEAD_DIM=64, BLOCK_D=64, BLOCK_S=16, TILE_N=64, WINDOW=True, PDL=True)),
        compile_one("store_kv", pa._store_kv_kernel, dict(k_ptr=bf, v_ptr=bf, kc_ptr=bf, vc_ptr=bf, slots_ptr="*i64"),
                    dict(BLOCK_SIZE=16, NUM_KV_HEADS=4, HEAD_DIM=64, BLOCK_HK=4, BLOCK_D=64, PDL=True)),
        compile_one("rms_norm", ew._rms_norm_kernel, dict(x_ptr=bf, w_ptr=bf, res_ptr=bf, out_ptr=bf, eps=F32),
                    dict(H=2048, BLOCK=2048, RESIDUAL=True, PDL=True)),
        compile_one("rotary", ew._rotary_kernel, dict(x_ptr=bf, pos_ptr="*i64", cos_ptr=bf, sin_ptr=bf),
                    dict(HEADS=32, HALF=32, BLOCK_H=32, BLOCK_HALF=32, PDL=True)),
        compile_one("silu_and_mul", ew._silu_and_mul_kernel, dict(x_ptr=bf, out_ptr=bf),
                    dict(INTER=5632, BLOCK=1024, PDL=True)),
        compile_one("rotary_qk", ew._rotary_qk_kernel, dict(q_ptr=bf, k_ptr=bf, pos_ptr="*i64", cos_ptr=bf, sin_ptr=bf),
                    dict(Q_HEADS=32, K_HEADS=4, HALF=32, BLOCK_QH=32, BLOCK_KH=4, BLOCK_HALF=32, PDL=True)),
    ]
    gemv_types = dict(x_ptr=bf, w_ptr=bf, b_ptr=bf, y_ptr=bf)
    ok += [compile_one(f"gemv rows={rows} block_n={block_n}{' gated' if gated else ''}{' two' if two else ''}",
                       gv._gemv_kernel, gemv_types,
                       dict(ROWS=rows, BLOCK_N=block_n, BLOCK_K=1024 if rows == 1 else 512, HAS_BIAS=not gated,
                            GATED=gated, TWO=two, PDL=pdl))
           for rows, block_n, gated, two, pdl in [(1, 2, False, True, True), (8, 2, False, False, False),
                                                 (1, 1, True, True, True), (1, 2, False, False, True)]]
    ok += [compile_one(f"gemv_dot {dt}", gv._gemv_dot_kernel, dict(x_ptr="*" + dt, w_ptr="*" + dt, b_ptr="*" + dt,
                                                                   y_ptr="*" + dt),
                       dict(BLOCK_N=32, BLOCK_K=256, HAS_BIAS=True, GATED=True, DOT_F32=dt == "fp32"))
           for dt in ("bf16", "fp32")]
    return 0 if all(ok) else 1


if __name__ == "__main__":
    sys.exit(main())
