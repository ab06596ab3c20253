"""The fused elementwise layers in Triton, with the signatures and rounding of the C++ CPU ops
(kernels/cpu/elementwise/fused_ops.cpp), so that `layers/` calls either through the same `ops` attribute
(`layers.use_cpu_kernels(model, TritonOps())` on a GPU):

- `rms_norm(x, weight, eps, residual)`: with a residual, residual += x in place (rounded to x's dtype) and
  the norm of that sum; out = round(weight * round(h * rsqrt(mean(h^2) + eps))), h in float32.
- `rotary_(x, positions, cos, sin)`: in place on x [T, H, D] (rows may be strided): the "rotate half"
  layout, round(round(x * cos) + round(rotate_half(x) * sin)); `rotary_qk_(q, k, ...)` both in one launch.
- `silu_and_mul(x)`: [T, 2I] -> [T, I], round(round(silu(gate)) * up).

`round` is a cast to the input's dtype; the arithmetic is float32."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.triton.common import pdl_args, pdl_wait


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, res_ptr, out_ptr, eps, stride_x, stride_r, stride_o, H: tl.constexpr,
                     BLOCK: tl.constexpr, RESIDUAL: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    row = tl.program_id(0)
    i = tl.arange(0, BLOCK)
    mask = i < H
    dtype = x_ptr.dtype.element_ty
    h = tl.load(x_ptr + row * stride_x + i, mask=mask, other=0.0).to(tl.float32)
    if RESIDUAL:
        summed = (h + tl.load(res_ptr + row * stride_r + i, mask=mask, other=0.0).to(tl.float32)).to(dtype)
        tl.store(res_ptr + row * stride_r + i, summed, mask=mask)
        h = summed.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(h * h, 0) / H + eps)
    normed = (h * inv).to(dtype).to(tl.float32)
    w = tl.load(w_ptr + i, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + i, (w * normed).to(dtype), mask=mask)


@triton.jit
def _rotate_heads(x_ptr, p, cos_ptr, sin_ptr, stride_h, stride_c, HEADS: tl.constexpr, HALF: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """One token's heads at x_ptr (head h at x_ptr + h * stride_h), rotated in place for position p."""
    h = tl.arange(0, BLOCK_H)
    j = tl.arange(0, BLOCK_HALF)
    mask = (h[:, None] < HEADS) & (j[None, :] < HALF)
    lo_ptr = x_ptr + h[:, None] * stride_h + j[None, :]
    dtype = x_ptr.dtype.element_ty
    a = tl.load(lo_ptr, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(lo_ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    c_lo = tl.load(cos_ptr + p * stride_c + j, mask=j < HALF, other=0.0).to(tl.float32)[None, :]
    c_hi = tl.load(cos_ptr + p * stride_c + HALF + j, mask=j < HALF, other=0.0).to(tl.float32)[None, :]
    s_lo = tl.load(sin_ptr + p * stride_c + j, mask=j < HALF, other=0.0).to(tl.float32)[None, :]
    s_hi = tl.load(sin_ptr + p * stride_c + HALF + j, mask=j < HALF, other=0.0).to(tl.float32)[None, :]
    lo = (a * c_lo).to(dtype).to(tl.float32) + (-b * s_lo).to(dtype).to(tl.float32)
    hi = (b * c_hi).to(dtype).to(tl.float32) + (a * s_hi).to(dtype).to(tl.float32)
    tl.store(lo_ptr, lo.to(dtype), mask=mask)
    tl.store(lo_ptr + HALF, hi.to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(x_ptr, pos_ptr, cos_ptr, sin_ptr, stride_t, stride_h, stride_c, HEADS: tl.constexpr,
                   HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    t = tl.program_id(0)
    _rotate_heads(x_ptr + t * stride_t, tl.load(pos_ptr + t), cos_ptr, sin_ptr, stride_h, stride_c, HEADS, HALF,
                  BLOCK_H, BLOCK_HALF)


@triton.jit
def _rotary_qk_kernel(q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_c,
                      Q_HEADS: tl.constexpr, K_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_QH: tl.constexpr,
                      BLOCK_KH: tl.constexpr, BLOCK_HALF: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    t = tl.program_id(0)
    p = tl.load(pos_ptr + t)
    _rotate_heads(q_ptr + t * stride_qt, p, cos_ptr, sin_ptr, stride_qh, stride_c, Q_HEADS, HALF, BLOCK_QH,
                  BLOCK_HALF)
    _rotate_heads(k_ptr + t * stride_kt, p, cos_ptr, sin_ptr, stride_kh, stride_c, K_HEADS, HALF, BLOCK_KH,
                  BLOCK_HALF)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, INTER: tl.constexpr, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
    pdl_wait(PDL)
    row = tl.program_id(0)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = i < INTER
    dtype = x_ptr.dtype.element_ty
    g = tl.load(x_ptr + row * stride_x + i, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + INTER + i, mask=mask, other=0.0).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + i, (silu * u).to(dtype), mask=mask)


class TritonOps:
    """The fused elementwise ops the layers call through their `ops` attribute, on a GPU."""

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None) -> torch.Tensor:
        rows, h = x.shape
        out = torch.empty_like(x)
        if rows:
            res = residual if residual is not None else x
            _rms_norm_kernel[(rows,)](x, weight, res, out, eps, x.stride(0), res.stride(0), out.stride(0), H=h,
                                      BLOCK=triton.next_power_of_2(h), RESIDUAL=residual is not None,
                                      **pdl_args(x.device))
        return out

    @staticmethod
    def rotary_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        t, heads, dim = x.shape
        assert x.stride(2) == 1 and cos.is_contiguous() and sin.is_contiguous()
        if t:
            _rotary_kernel[(t,)](x, positions, cos, sin, x.stride(0), x.stride(1), cos.stride(0), HEADS=heads,
                                 HALF=dim // 2, BLOCK_H=triton.next_power_of_2(heads),
                                 BLOCK_HALF=triton.next_power_of_2(dim // 2), **pdl_args(x.device))

    @staticmethod
    def rotary_qk_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor) -> None:
        """rotary_ on q [T, Hq, D] and k [T, Hk, D] in one launch."""
        t, q_heads, dim = q.shape
        k_heads = k.shape[1]
        assert q.stride(2) == 1 and k.stride(2) == 1 and cos.is_contiguous() and sin.is_contiguous()
        if t:
            _rotary_qk_kernel[(t,)](q, k, positions, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                                    cos.stride(0), Q_HEADS=q_heads, K_HEADS=k_heads, HALF=dim // 2,
                                    BLOCK_QH=triton.next_power_of_2(q_heads), BLOCK_KH=triton.next_power_of_2(k_heads),
                                    BLOCK_HALF=triton.next_power_of_2(dim // 2), **pdl_args(q.device))

    @staticmethod
    def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
        rows, two_inter = x.shape
        inter = two_inter // 2
        out = torch.empty(rows, inter, dtype=x.dtype, device=x.device)
        block = min(1024, triton.next_power_of_2(inter))
        if rows:
            _silu_and_mul_kernel[(rows, triton.cdiv(inter, block))](x, out, x.stride(0), out.stride(0), INTER=inter,
                                                                    BLOCK=block, **pdl_args(x.device))
        return out
