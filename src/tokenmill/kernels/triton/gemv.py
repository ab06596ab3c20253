"""A GEMV in Triton for decode-sized batches on a GPU: y [M, N] = x [M, K] @ W [N, K]^T (+ bias), M at most
GEMV_MAX_ROWS, W row-major as the checkpoint holds it.

At batch 1 a decode step's time is the time to read the weights once, and cuBLAS's split-K GEMV tiles for
these shapes read them at well under the device's bandwidth (bench/README.md, "The GPU path's check"). Each
program here owns BLOCK_N output features and streams their rows over K in BLOCK_K slices, accumulating in
float32 elementwise and reducing over K once at the end; nothing is split over K, so there is no second reduce
kernel. `gated`: x is a fused gate/up projection's output [M, 2K] and the kernel multiplies
silu(gate) * up, rounded as `SiluAndMul`'s fused op rounds it, so the MLP's down projection needs no separate
activation kernel."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

GEMV_MAX_ROWS = 8  # the most rows `gemv` takes
ENGINE_GEMV_ROWS = 1  # the layers take it for one row (a batch-1 decode step); cuBLAS beyond (bench/README.md)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym, ROWS: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    m = tl.arange(0, ROWS)
    m_mask = m < M
    dtype = x_ptr.dtype.element_ty
    # products summed over K once, at the end; one row keeps a 2-D accumulator (the 3-D one, [1, BLOCK_N,
    # BLOCK_K], was the slower on an H200: bench/README.md)
    if ROWS == 1:
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    else:
        acc = tl.zeros([ROWS, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        w = tl.load(w_ptr + n[:, None] * stride_wn + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0,
                    eviction_policy="evict_first").to(tl.float32)
        x_mask = m_mask[:, None] & k_mask[None, :]
        x_at = x_ptr + m[:, None] * stride_xm + k[None, :]
        if GATED:
            g = tl.load(x_at, mask=x_mask, other=0.0).to(tl.float32)
            u = tl.load(x_at + K, mask=x_mask, other=0.0).to(tl.float32)
            x = ((g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32) * u).to(dtype).to(tl.float32)
        else:
            x = tl.load(x_at, mask=x_mask, other=0.0).to(tl.float32)
        if ROWS == 1:
            acc2 += w * x
        else:
            acc += x[:, None, :] * w[None, :, :]
    if ROWS == 1:
        y = tl.sum(acc2, axis=1)[None, :]
    else:
        y = tl.sum(acc, axis=2)
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + m[:, None] * stride_ym + n[None, :], y.to(y_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def gemv_config(rows: int, n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for these shapes: at one row, the tiles tools/gemv_bench.py --sweep found
    the fastest over a 1.1B Llama's projections on an H200 (bench/README.md); many small programs keep every
    SM streaming."""
    return 2, min(1024 if rows == 1 else 512, triton.next_power_of_2(k)), 4


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, gated: bool = False,
         config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """x [M, K] (or [M, 2K] gated: silu of the first half times the second) @ weight [N, K]^T + bias -> [M, N]
    in x's dtype. `config`: (BLOCK_N, BLOCK_K, num_warps) instead of gemv_config's."""
    rows, width = x.shape
    n, k = weight.shape
    if width != (2 * k if gated else k):
        raise ValueError(f"x of width {width} does not fit a weight of {k} inputs{' (gated)' if gated else ''}")
    if rows > GEMV_MAX_ROWS:
        raise ValueError(f"the GEMV takes at most {GEMV_MAX_ROWS} rows, not {rows}")
    assert x.stride(1) == 1 and weight.is_contiguous()
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows == 0:
        return y
    block_n, block_k, warps = config or gemv_config(rows, n, k)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, y, rows, n, k, x.stride(0), weight.stride(0), y.stride(0),
        ROWS=triton.next_power_of_2(rows), BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=bias is not None, GATED=gated,
        num_warps=warps)
    return y


class TritonGemv:
    """The GEMV in the form `UnquantizedLinearMethod` takes a decode kernel (`LinearBase.gemv_ops`):
    `packed_gemv(rows, weight, bias)` over the layer's weight as it holds it (row-major on a GPU), and
    `gated_gemv`, the down projection's with SiLU-and-mul in front (`LinearBase.gated_forward`)."""

    @staticmethod
    def packed_gemv(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return gemv(rows, weight, bias)

    @staticmethod
    def gated_gemv(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return gemv(gate_up, weight, bias, gated=True)

    @staticmethod
    def packed_gemv_max_rows(input_size: int) -> int:
        return ENGINE_GEMV_ROWS
