"""The quantized weights' layouts that tokenmill's kernels read, how a float or integer weight becomes
one, and the torch reference of each kernel (dequantize, then a float matmul; for W8A8 the same integer
products the kernel makes).

- int8 (W8A16): `q` int8 [N, K], `scale` fp32 [N], `wsum` int32 [N] (row sums of q); w = q * scale.
- int4 (W4A16): `packed` uint8 [N, Kp/2], Kp = K padded to 32: in each run of 32 k, byte j holds k = j
  (low nibble) and k = j + 16 (high nibble), unsigned 0..15; `scale`, `zero` fp32 [N, ceil(K / group)]
  (`zero` empty where every zero point is 8, the symmetric case); w = (q - zero) * scale. The padding
  nibbles are zero and x is zero there.
- W8A8: `q` int8 [N, Kp], Kp = K padded to 64 with zeros, `scale` fp32 [N], `wsum` int32 [N] (row sums
  of q); x is quantized per row to int8 with scale amax / 127.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.quantization_config import INT4_K_ALIGN, W8A8_K_ALIGN, round_up


def num_groups(in_features: int, group: int) -> int:
    return -(-in_features // group)


# ---- making the layouts ----------------------------------------------------------------------------

def rtn_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric round-to-nearest per output row: (q int8 [N, K], scale fp32 [N])."""
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-10) / 127
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def rtn_int4(weight: torch.Tensor, group: int, zero_point: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group-wise round-to-nearest: (q uint8 [N, K] in 0..15, scale fp32 [N, G], zero fp32 [N, G]).
    Symmetric: zero 8 and scale amax / 7.5 (so -8..7 cover the range); asymmetric: min..max onto 0..15."""
    w = weight.float()
    n, k = w.shape
    g = num_groups(k, group)
    padded = F.pad(w, (0, g * group - k)).view(n, g, group)
    if zero_point:
        lo = padded.amin(dim=2).clamp(max=0)
        hi = padded.amax(dim=2).clamp(min=0)
        scale = ((hi - lo) / 15).clamp(min=1e-10)
        zero = torch.round(-lo / scale).clamp(0, 15)
    else:
        scale = padded.abs().amax(dim=2).clamp(min=1e-10) / 7.5
        zero = torch.full_like(scale, 8.0)
    q = torch.round(padded / scale[..., None] + zero[..., None]).clamp(0, 15)
    return q.view(n, g * group)[:, :k].to(torch.uint8), scale, zero


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q uint8 [N, K] (values 0..15) -> the kernels' packed [N, Kp/2]."""
    n, k = q.shape
    runs = F.pad(q.to(torch.uint8), (0, round_up(k, INT4_K_ALIGN) - k)).view(n, -1, 2, 16)
    return (runs[:, :, 0, :] | (runs[:, :, 1, :] << 4)).reshape(n, -1).contiguous()


def unpack_int4(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """The kernels' packed [N, Kp/2] -> q uint8 [N, K]."""
    n = packed.shape[0]
    runs = packed.view(n, -1, 16)
    return torch.stack([runs & 0xF, runs >> 4], dim=2).reshape(n, -1)[:, :in_features]


def weight_sum(q: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] -> its row sums, int32 [N] (what the kernels' u8 x s8 products take off again)."""
    return q.to(torch.int32).sum(dim=1).to(torch.int32)


def w8a8_layout(q: torch.Tensor, wsum: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 [N, K] -> (the W8A8 kernel's zero-padded [N, Kp], row sums int32 [N]: `wsum` where already made)."""
    k = q.shape[1]
    return F.pad(q, (0, round_up(k, W8A8_K_ALIGN) - k)).contiguous(), weight_sum(q) if wsum is None else wsum


# ---- the references -----------------------------------------------------------------------------------

def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale[:, None]


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, in_features: int,
                    group: int) -> torch.Tensor:
    """zero empty: 8 throughout (symmetric)."""
    q = unpack_int4(packed, in_features).float()
    expand = torch.arange(in_features, device=q.device) // group
    return (q - (zero[:, expand] if zero.numel() else 8.0)) * scale[:, expand]


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-row int8: (xq int8-valued float [M, K], scale [M]), rounding half to even."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1).clamp(min=1e-10) / 127
    return torch.round(xf / scale[:, None]).clamp(-127, 127), scale


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear with a dequantized fp32 weight made for this call, in x's dtype."""
    return F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))


def w8a8_ref(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, in_features: int,
             bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K]: the integer products exactly (in float64), scaled as the kernel scales them."""
    xq, xs = quantize_rows(x)
    dot = (xq.double() @ q[:, :in_features].double().T).float()
    y = dot * (xs[:, None] * scale[None, :])
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
