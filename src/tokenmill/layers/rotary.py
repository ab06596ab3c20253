"""Rotary position embedding (the non-interleaved "rotate half" layout of HF Llama), with the
default, linear, llama3, longrope and yarn frequency schedules. cos/sin are precomputed per position.

LongRoPE (Phi-3) divides the frequencies by `short_factor` and, from `original_max_position_embeddings`
on, by `long_factor`, and scales cos and sin by `attention_factor`. transformers picks one set per forward
call, long where the call's sequence is longer than the original length; here a position takes the set
its own position calls for, which is transformers' choice for every token of a prompt no longer than the
original length and for every generated token, and which keeps a position's keys the same whatever the
batching, chunking or prefix-cache hits (a prompt longer than the original length is rotated with the
short set below it, where transformers rotates the whole prompt with the long set)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from tokenmill.arch import RopeConfig


def inv_frequencies(rot_dim: int, rope: RopeConfig, long: bool = False) -> torch.Tensor:
    """The inverse frequencies; for longrope, the short set or with `long` the long one."""
    # computed on the CPU whatever the default device (RotaryEmbedding moves the tables once)
    exponents = torch.arange(0, rot_dim, 2, dtype=torch.int64, device="cpu").float() / rot_dim
    if rope.rope_type == "longrope":
        factors = rope.long_factor if long else rope.short_factor
        if len(factors) != rot_dim // 2:
            raise ValueError(f"longrope {'long' if long else 'short'}_factor has {len(factors)} entries; "
                             f"the rotary dimension {rot_dim} needs {rot_dim // 2}")
        return 1.0 / (torch.tensor(factors, dtype=torch.float32, device="cpu") * rope.theta**exponents)
    inv_freq = 1.0 / (rope.theta ** exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "yarn":
        return _yarn(inv_freq, rot_dim, rope)
    if rope.rope_type == "llama3":
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.rot_dim = int(head_dim * rope.partial_rotary_factor)
        self.ops = None  # tokenmill's C++ CPU kernels (or the Triton ones), once use_cpu_kernels sets them
        self.fused_dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,)  # the activations `ops` takes
        positions = torch.arange(max_positions, dtype=torch.float32, device="cpu")[:, None]
        freqs = positions * inv_frequencies(self.rot_dim, rope)[None, :]
        if rope.rope_type == "longrope":
            long = positions >= rope.original_max_position_embeddings
            freqs = torch.where(long, positions * inv_frequencies(self.rot_dim, rope, long=True)[None, :], freqs)
        emb = torch.cat((freqs, freqs), dim=-1)
        scale = attention_factor(rope)
        device = torch.get_default_device()  # the model is built under its device's context
        self.cos_cache: torch.Tensor
        self.sin_cache: torch.Tensor
        self.register_buffer("cos_cache", (emb.cos() * scale).to(dtype=dtype, device=device), persistent=False)
        self.register_buffer("sin_cache", (emb.sin() * scale).to(dtype=dtype, device=device), persistent=False)

    @property
    def ops(self) -> Any:
        return self._ops

    @ops.setter
    def ops(self, ops: Any) -> None:
        self._ops = ops
        self._rotary_qk = getattr(ops, "rotary_qk_", None)  # q and k in one call, where the ops have it

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D], k: [T, Hk, D]; returns them rotated (in place on the fused path)."""
        if self.ops is not None and q.dtype in self.fused_dtypes and self.rot_dim == q.shape[-1]:
            if self._rotary_qk is not None:  # (the Triton ops: one launch)
                self._rotary_qk(q, k, positions, self.cos_cache, self.sin_cache)
                return q, k
            self.ops.rotary_(q, positions, self.cos_cache, self.sin_cache)
            self.ops.rotary_(k, positions, self.cos_cache, self.sin_cache)
            return q, k
        cos = self.cos_cache[positions].unsqueeze(1)
        sin = self.sin_cache[positions].unsqueeze(1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.rot_dim < x.shape[-1]:
            x_rot, x_pass = x[..., : self.rot_dim], x[..., self.rot_dim:]
            return torch.cat((self._rotate(x_rot, cos, sin), x_pass), dim=-1)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(inv_freq: torch.Tensor, rot_dim: int, rope: RopeConfig) -> torch.Tensor:
    """YaRN: interpolated frequencies (divided by `factor`) below the low-rotation boundary,
    the original ones above the high one, a linear ramp between."""

    def correction_dim(rotations: float) -> float:
        return (rot_dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi))
                / (2 * math.log(rope.theta)))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rot_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rot_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    pos_freqs = rope.theta ** (torch.arange(0, rot_dim, 2, dtype=torch.int64, device="cpu").float() / rot_dim)
    return 1.0 / (rope.factor * pos_freqs) * (1 - extrapolation) + inv_freq * extrapolation


def attention_factor(rope: RopeConfig) -> float:
    """The scale longrope and yarn apply to cos and sin (1 for every other schedule)."""
    if rope.rope_type == "longrope":
        return 1.0 if rope.attention_factor is None else rope.attention_factor
    if rope.rope_type != "yarn":
        return 1.0
    if rope.attention_factor is not None:
        return rope.attention_factor
    if rope.mscale and rope.mscale_all_dim:
        return _yarn_mscale(rope.factor, rope.mscale) / _yarn_mscale(rope.factor, rope.mscale_all_dim)
    return _yarn_mscale(rope.factor)


def yarn_softmax_scale(rope: RopeConfig) -> float:
    """DeepSeek's extra softmax scale under yarn: mscale(factor, mscale_all_dim) squared."""
    if rope.rope_type == "default" or not rope.mscale_all_dim:
        return 1.0
    return _yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2
