"""A GEMV in Triton for decode-sized batches on a GPU: y [M, N] = x [M, K] @ W [N, K]^T (+ bias), M at most
GEMV_MAX_ROWS, W row-major as the checkpoint holds it.

At batch 1 a decode step's time is the time to read the weights once, and cuBLAS's split-K GEMV tiles for
these shapes read them at well under the device's bandwidth (bench/README.md, "The GPU path's check"). Each
program here owns BLOCK_N output features and streams their rows over K in BLOCK_K slices, accumulating in
float32 elementwise and reducing over K once at the end; nothing is split over K, so there is no second reduce
kernel. `gated`: x is a fused gate/up projection's output [M, 2K] and the kernel multiplies
silu(gate) * up, rounded as `SiluAndMul`'s fused op rounds it (the layers do not take that form: see
`TritonGemv`). `gemv_dot` takes up to 16 rows as tile products (tensor cores), for decode batches of 2-16
where this GEMV loses to cuBLAS; the layers do not take it yet (tools/gemv_bench.py times it)."""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from tokenmill.kernels.triton.common import interpreting, pdl_args, pdl_wait

GEMV_MAX_ROWS = 8  # the most rows `gemv` takes
GEMV_DOT_MAX_ROWS = 16  # the most rows `gemv_dot` takes: one tile of tl.dot's least height
ENGINE_GEMV_ROWS = 1  # the layers take it for one row (a batch-1 decode step); cuBLAS beyond (bench/README.md)


@triton.jit
def _load_x(x_at, x_mask, K, GATED: tl.constexpr, dtype: tl.constexpr):
    """x's [rows, BLOCK_K] slice in its dtype; gated: round(round(silu(gate)) * up), gate at x_at, up K on."""
    if GATED:
        g = tl.load(x_at, mask=x_mask, other=0.0).to(tl.float32)
        u = tl.load(x_at + K, mask=x_mask, other=0.0).to(tl.float32)
        return ((g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32) * u).to(dtype)
    return tl.load(x_at, mask=x_mask, other=0.0)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym, ROWS: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
                 TWO: tl.constexpr, PDL: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    m = tl.arange(0, ROWS)
    m_mask = m < M
    dtype = x_ptr.dtype.element_ty
    # the first K slice of the weight (the first two where K has more than one: TWO) is loaded before the wait
    # on the kernel before (PDL): no kernel writes the weights, so under PDL those loads overlap that kernel's end
    k = tl.arange(0, BLOCK_K)
    w = _load_w(w_ptr, n, k, n_mask, K, stride_wn)
    if TWO:
        w1 = _load_w(w_ptr, n, BLOCK_K + k, n_mask, K, stride_wn)
    pdl_wait(PDL)
    x_at = x_ptr + m[:, None] * stride_xm
    # products summed over K once, at the end; one row keeps a 2-D accumulator (the 3-D one, [1, BLOCK_N,
    # BLOCK_K], was the slower on an H200: bench/README.md)
    acc = _slice_products(x_at, m_mask, k, K, w, GATED, dtype, ROWS)
    if TWO:
        acc += _slice_products(x_at, m_mask, BLOCK_K + k, K, w1, GATED, dtype, ROWS)
    for k0 in range(BLOCK_K * (2 if TWO else 1), K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        acc += _slice_products(x_at, m_mask, ks, K, _load_w(w_ptr, n, ks, n_mask, K, stride_wn), GATED, dtype, ROWS)
    if ROWS == 1:
        y = tl.sum(acc, axis=1)[None, :]
    else:
        y = tl.sum(acc, axis=2)
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + m[:, None] * stride_ym + n[None, :], y.to(y_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _slice_products(x_at, m_mask, k, K, w, GATED: tl.constexpr, dtype: tl.constexpr, ROWS: tl.constexpr):
    """x's K slice `k` times the weight's ([BLOCK_N, BLOCK_K] float32, w), elementwise: [BLOCK_N, BLOCK_K] for
    one row, [ROWS, BLOCK_N, BLOCK_K] for more."""
    x = _load_x(x_at + k[None, :], m_mask[:, None] & (k < K)[None, :], K, GATED, dtype).to(tl.float32)
    if ROWS == 1:
        products = w * x
    else:
        products = x[:, None, :] * w[None, :, :]
    return products


@triton.jit
def _load_w(w_ptr, n, k, n_mask, K, stride_wn):
    """The weight's [BLOCK_N, BLOCK_K] slice in float32, streamed past the cache (each is read once a step)."""
    return tl.load(w_ptr + n[:, None] * stride_wn + k[None, :], mask=n_mask[:, None] & (k < K)[None, :], other=0.0,
                   eviction_policy="evict_first").to(tl.float32)


@triton.jit
def _gemv_dot_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr, DOT_F32: tl.constexpr):
    """Up to 16 rows as one tile product a slice (the rows padded to tl.dot's least 16); DOT_F32: float32
    products in IEEE precision (float32 weights, and the interpreter's bf16)."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    m = tl.arange(0, 16)
    m_mask = m < M
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        w = tl.load(w_ptr + n[:, None] * stride_wn + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0,
                    eviction_policy="evict_first")
        x = _load_x(x_ptr + m[:, None] * stride_xm + k[None, :], m_mask[:, None] & k_mask[None, :], K, GATED, dtype)
        if DOT_F32:
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + m[:, None] * stride_ym + n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def gemv_config(rows: int, n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for these shapes: at one row, the tiles tools/gemv_bench.py --sweep found
    the fastest, or nearly, at each of a 1.1B Llama's projections on an H200 (bench/README.md); many small
    programs keep every SM streaming."""
    return 2, min(1024 if rows == 1 else 512, triton.next_power_of_2(k)), 4


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, gated: bool = False,
         config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """x [M, K] (or [M, 2K] gated: silu of the first half times the second) @ weight [N, K]^T + bias -> [M, N]
    in x's dtype. `config`: (BLOCK_N, BLOCK_K, num_warps) instead of gemv_config's."""
    rows, n, k = _check(x, weight, gated, GEMV_MAX_ROWS)
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows == 0:
        return y
    block_n, block_k, warps = config or gemv_config(rows, n, k)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, y, rows, n, k, x.stride(0), weight.stride(0), y.stride(0),
        ROWS=triton.next_power_of_2(rows), BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=bias is not None, GATED=gated,
        TWO=k > block_k, num_warps=warps, **pdl_args(x.device))
    return y


def gemv_dot(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, gated: bool = False,
             config: tuple[int, int, int] = (32, 256, 4)) -> torch.Tensor:
    """`gemv` for 1 to GEMV_DOT_MAX_ROWS rows by tile products (tensor cores for bf16), `config` (BLOCK_N, BLOCK_K,
    num_warps). Not taken by the layers yet: tools/gemv_bench.py times it against cuBLAS at 2-16 rows."""
    rows, n, k = _check(x, weight, gated, GEMV_DOT_MAX_ROWS)
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows:
        block_n, block_k, warps = config
        _gemv_dot_kernel[(triton.cdiv(n, block_n),)](
            x, weight, bias if bias is not None else weight, y, rows, n, k, x.stride(0), weight.stride(0), y.stride(0),
            BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=bias is not None, GATED=gated,
            DOT_F32=x.dtype == torch.float32 or interpreting(), num_warps=warps)
    return y


def _check(x: torch.Tensor, weight: torch.Tensor, gated: bool, max_rows: int) -> tuple[int, int, int]:
    """(rows, N, K) of a GEMV's operands; a ValueError where they do not fit."""
    rows, width = x.shape
    n, k = weight.shape
    if width != (2 * k if gated else k):
        raise ValueError(f"x of width {width} does not fit a weight of {k} inputs{' (gated)' if gated else ''}")
    if rows > max_rows:
        raise ValueError(f"the GEMV takes at most {max_rows} rows, not {rows}")
    assert x.stride(1) == 1 and weight.is_contiguous()
    return rows, n, k


def gated_gemv(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The down projection with SiLU-and-mul in front, in the form `LinearBase.gated_forward` takes."""
    return gemv(gate_up, weight, bias, gated=True)


class TritonGemv:
    """The GEMV in the form `UnquantizedLinearMethod` takes a decode kernel (`LinearBase.gemv_ops`):
    `packed_gemv(rows, weight, bias)` over the layer's weight as it holds it (row-major on a GPU).

    `gated_gemv` (the down projection's GEMV with SiLU-and-mul in front, `LinearBase.gated_forward`) is not
    offered: in the engine's batch-1 step it was slower than a separate SiLU-and-mul kernel before the plain
    GEMV (bench/README.md); tools/gpu_bench.py --gated on sets it to the module's `gated_gemv` for an A/B."""

    gated_gemv: Any = None

    @staticmethod
    def packed_gemv(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return gemv(rows, weight, bias)

    @staticmethod
    def packed_gemv_max_rows(input_size: int) -> int:
        return ENGINE_GEMV_ROWS
