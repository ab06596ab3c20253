"""Paged attention in Triton over the cache layout of `attention/`: [num_blocks, block_size, Hk, D] per K
and V, block tables of physical block ids, and for a quantized cache (int8 / fp8 e4m3) one float32 scale
per token and kv head, [num_blocks, block_size, Hk] (value = element * scale).

- `store_kv`: this step's keys and values into their slots; a negative slot is skipped (the padded rows
  of a CUDA-graph batch).
- `paged_decode`: one query row per sequence, flash-decoding: the context is cut into `num_splits`
  ranges of key tiles, each program (sequence, kv head, split) attends all the query heads of its kv
  head's group at once (GQA: the group is the rows of one tile product) and writes its partial output
  and log-sum-exp; a second kernel combines the splits. The ranges are cut from the row's own context, so
  a context shorter than `num_splits` ranges of tiles fills only the first ones: the others write nothing
  and the combine reads only the filled ones (a CUDA graph fixes `num_splits` for the longest context).
- `paged_prefill`: the prefill chunks of a step in one launch, each query tile (sequence, BLOCK_Q of its
  query rows, the group's heads folded into the rows) attending over the sequence's cached prefix and its
  own rows causally; a chunk of a long prompt and a prompt with prefix-cache hits are the same case.

Keys are read in tiles of TILE_N positions across block boundaries (each position's block id read from
the table), so the tile does not depend on the cache's block size. Sliding windows skip the tiles before
the window; soft-capping is cap * tanh(s / cap), tanh written with exp. Scores and the softmax are
float32; the tile products take the inputs' dtype (float32 products at IEEE precision, no TF32), or
float32 with `dot_f32` (the interpreter, whose bf16 arithmetic is not exact).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.triton.common import interpreting, pdl_args, pdl_wait

NEG = tl.constexpr(-1.0e30)  # the running max's start: finite, so that a row that sees nothing stays 0, not NaN


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slots_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cb, stride_cs, stride_ch, BLOCK_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                     HEAD_DIM: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_HK)
    d = tl.arange(0, BLOCK_D)
    if slot >= 0:
        mask = (h[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_DIM)
        dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + h[:, None] * stride_ch + d[None, :]
        k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
        v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
        tl.store(kc_ptr + dst, k, mask=mask)
        tl.store(vc_ptr + dst, v, mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k/v [T, Hk, D] (last dimension contiguous) into the caches' slots; slots < 0 are skipped."""
    t, hk, dim = k.shape
    if t == 0:
        return
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1
    _store_kv_kernel[(t,)](k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0),
                           v.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                           BLOCK_SIZE=k_cache.shape[1], NUM_KV_HEADS=hk, HEAD_DIM=dim,
                           BLOCK_HK=triton.next_power_of_2(hk), BLOCK_D=triton.next_power_of_2(dim),
                           **pdl_args(k.device))


@triton.jit
def _load_kv(cache_ptr, scale_ptr, blk, off, kvh, d, valid, stride_cb, stride_cs, stride_ch, stride_sb, stride_ss,
             HEAD_DIM: tl.constexpr, QUANT: tl.constexpr):
    """[TILE_N, BLOCK_D] float32 keys (or values) of the tile's valid positions, dequantized where QUANT."""
    x = tl.load(cache_ptr + blk[:, None] * stride_cb + off[:, None] * stride_cs + kvh * stride_ch + d[None, :],
                mask=valid[:, None] & (d[None, :] < HEAD_DIM), other=0.0).to(tl.float32)
    if QUANT:
        s = tl.load(scale_ptr + blk * stride_sb + off * stride_ss + kvh, mask=valid, other=0.0)
        x = x * s[:, None]
    return x


@triton.jit
def _scores(q, k, scale, softcap, DOT_F32: tl.constexpr, SOFTCAP: tl.constexpr):
    if DOT_F32:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k.to(q.dtype)))
    s = s * scale
    if SOFTCAP:
        # cap * tanh(s / cap), tanh(x) = 1 - 2 / (exp(2x) + 1)
        s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
    return s


@triton.jit
def _pv(p, v, q, DOT_F32: tl.constexpr):
    if DOT_F32:
        return tl.dot(p, v, input_precision="ieee")
    return tl.dot(p.to(q.dtype), v.to(q.dtype))


@triton.jit
def _tile_kv(kc_ptr, vc_ptr, ks_ptr, vs_ptr, table_ptr, pos, valid, kvh, d, stride_cb, stride_cs, stride_ch,
             stride_sb, stride_ss, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, QUANT: tl.constexpr):
    """K and V [TILE_N, BLOCK_D] of one kv head at positions `pos` of a sequence (its block table row at
    table_ptr), zero where not `valid`."""
    blk = tl.load(table_ptr + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    off = pos % BLOCK_SIZE
    k = _load_kv(kc_ptr, ks_ptr, blk, off, kvh, d, valid, stride_cb, stride_cs, stride_ch, stride_sb, stride_ss,
                 HEAD_DIM, QUANT)
    v = _load_kv(vc_ptr, vs_ptr, blk, off, kvh, d, valid, stride_cb, stride_cs, stride_ch, stride_sb, stride_ss,
                 HEAD_DIM, QUANT)
    return k, v


@triton.jit
def _online_softmax_step(m_i, l_i, acc, s, v, q, DOT_F32: tl.constexpr):
    """Flash attention's running max, sum and output after one tile of masked scores `s` and its values."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    return m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None] + _pv(p, v, q, DOT_F32)


@triton.jit
def _decode_split_kernel(
        q_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, tables_ptr, lens_ptr, part_out_ptr, part_lse_ptr, out_ptr,
        scale, softcap, window, num_splits,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch, stride_sb, stride_ss, stride_tb,
        GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, QUANT: tl.constexpr, SOFTCAP: tl.constexpr,
        WINDOW: tl.constexpr, DOT_F32: tl.constexpr, DIRECT: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    num_q_heads = tl.num_programs(1) * GROUP
    ctx = tl.load(lens_ptr + b)
    lo, first, per_split, active = _split_tiles(ctx, window, num_splits, TILE_N, WINDOW)
    if split < active:  # the splits past the context's tiles write nothing; the reduce reads the active ones
        hg = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        heads = kvh * GROUP + hg
        q_mask = (hg[:, None] < GROUP) & (d[None, :] < HEAD_DIM)
        q = tl.load(q_ptr + b * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0)
        if DOT_F32:
            q = q.to(tl.float32)
        t0 = first + split * per_split
        t1 = tl.minimum(t0 + per_split, tl.cdiv(ctx, TILE_N))
        m_i = tl.full([BLOCK_H], NEG, tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        for t in range(t0, t1):
            pos = t * TILE_N + tl.arange(0, TILE_N)
            valid = (pos < ctx) & (pos >= lo)
            k, v = _tile_kv(kc_ptr, vc_ptr, ks_ptr, vs_ptr, tables_ptr + b * stride_tb, pos, valid, kvh, d,
                            stride_cb, stride_cs, stride_ch, stride_sb, stride_ss, BLOCK_SIZE, HEAD_DIM, QUANT)
            s = _scores(q, k, scale, softcap, DOT_F32, SOFTCAP)
            s = tl.where(valid[None, :], s, float("-inf"))
            m_i, l_i, acc = _online_softmax_step(m_i, l_i, acc, s, v, q, DOT_F32)
        seen = l_i > 0
        out = acc / tl.where(seen, l_i, 1.0)[:, None]
        if DIRECT:  # one split: the output itself
            tl.store(out_ptr + b * stride_ot + heads[:, None] * stride_oh + d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=q_mask)
        else:
            lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), NEG)
            row = (b * num_q_heads + heads) * num_splits + split
            h_mask = hg < GROUP
            tl.store(part_out_ptr + row[:, None] * BLOCK_D + d[None, :], out, mask=h_mask[:, None])
            tl.store(part_lse_ptr + row, lse, mask=h_mask)


@triton.jit
def _split_tiles(ctx, window, num_splits, TILE_N: tl.constexpr, WINDOW: tl.constexpr):
    """A decode row's key tiles cut into ranges: (the first position it attends, its first tile, tiles a
    range, ranges that hold tiles). The ranges are as even as `num_splits` allows at this context, so a
    short context fills fewer of them; a row with no keys has one range, which writes zeros."""
    lo = 0
    if WINDOW:
        lo = tl.maximum(ctx - window, 0)
    first = lo // TILE_N
    tiles = tl.cdiv(ctx, TILE_N) - first
    per_split = tl.maximum(tl.cdiv(tiles, num_splits), 1)
    return lo, first, per_split, tl.maximum(tl.cdiv(tiles, per_split), 1)


@triton.jit
def _decode_reduce_kernel(part_out_ptr, part_lse_ptr, lens_ptr, out_ptr, num_splits, window, stride_ot, stride_oh,
                          HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, TILE_N: tl.constexpr,
                          WINDOW: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    row = b * tl.num_programs(1) + h
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    _, _, _, active = _split_tiles(tl.load(lens_ptr + b), window, num_splits, TILE_N, WINDOW)
    s_mask = s < active
    lse = tl.load(part_lse_ptr + row * num_splits + s, mask=s_mask, other=NEG)
    w = tl.where(s_mask, tl.exp(lse - tl.max(lse, 0)), 0.0)
    o = tl.load(part_out_ptr + (row * num_splits + s)[:, None] * BLOCK_D + d[None, :], mask=s_mask[:, None],
                other=0.0)
    res = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
    tl.store(out_ptr + b * stride_ot + h * stride_oh + d, res.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def decode_splits(batch: int, kv_heads: int, max_context: int, tile_n: int, target_programs: int = 264) -> int:
    """How many key ranges each decode row's context is cut into: enough programs to fill the device,
    at least two tiles a range, at most 64 ranges. Depends only on the batch's shape and the longest
    context it may hold (a CUDA graph fixes it at capture)."""
    want = max(1, -(-target_programs // max(1, batch * kv_heads)))
    return max(1, min(want, -(-max_context // (2 * tile_n)), 64))


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                 lens: torch.Tensor, scale: float, out: torch.Tensor, *, window: int | None = None,
                 softcap: float | None = None, k_scales: torch.Tensor | None = None,
                 v_scales: torch.Tensor | None = None, num_splits: int | None = None, tile_n: int = 64) -> None:
    """q [B, Hq, D] (one row per sequence) over its context of lens[b] cached positions (block table
    tables[b], int32 [B, max_blocks]) into out [B, Hq, D]. A row with length 0 gets zeros."""
    batch, hq, dim = q.shape
    if batch == 0:
        return
    hk = k_cache.shape[2]
    group = hq // hk
    block_d = max(16, triton.next_power_of_2(dim))
    if num_splits is None:
        num_splits = decode_splits(batch, hk, tables.shape[1] * k_cache.shape[1], tile_n)
    direct = num_splits == 1
    part_out = torch.empty(0 if direct else batch * hq * num_splits, block_d, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(0 if direct else batch * hq * num_splits, dtype=torch.float32, device=q.device)
    quant = k_scales is not None
    ks, vs, stride_sb, stride_ss = _scale_args(k_scales, v_scales, lens)
    _decode_split_kernel[(batch, hk, num_splits)](
        q, k_cache, v_cache, ks, vs, tables, lens, part_out, part_lse, out,
        scale, softcap or 1.0, window or 0, num_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), stride_sb, stride_ss, tables.stride(0),
        GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), HEAD_DIM=dim, BLOCK_D=block_d,
        BLOCK_SIZE=k_cache.shape[1], TILE_N=tile_n, QUANT=quant, SOFTCAP=softcap is not None,
        WINDOW=window is not None, DOT_F32=_dot_f32(q), DIRECT=direct, **pdl_args(q.device))
    if not direct:
        _decode_reduce_kernel[(batch, hq)](part_out, part_lse, lens, out, num_splits, window or 0, out.stride(0),
                                           out.stride(1), HEAD_DIM=dim, BLOCK_D=block_d,
                                           BLOCK_S=max(2, triton.next_power_of_2(num_splits)), TILE_N=tile_n,
                                           WINDOW=window is not None, **pdl_args(q.device))


@triton.jit
def _prefill_kernel(
        q_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, tables_ptr, lens_ptr, starts_ptr, tile_seq_ptr, tile_q0_ptr,
        out_ptr, scale, softcap, window,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch, stride_sb, stride_ss,
        stride_tb,
        GROUP: tl.constexpr, G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, QUANT: tl.constexpr,
        SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, DOT_F32: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    b = tl.load(tile_seq_ptr + tile)
    q0 = tl.load(tile_q0_ptr + tile)
    q_start = tl.load(starts_ptr + b)
    q_len = tl.load(starts_ptr + b + 1) - q_start
    ctx = tl.load(lens_ptr + b)
    r = tl.arange(0, BLOCK_Q * G_PAD)
    tok = q0 + r // G_PAD
    hg = r % G_PAD
    row_mask = (tok < q_len) & (hg < GROUP)
    q_pos = ctx - q_len + tok
    heads = kvh * GROUP + hg
    d = tl.arange(0, BLOCK_D)
    q_mask = row_mask[:, None] & (d[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + (q_start + tok)[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=q_mask, other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    hi = tl.minimum(ctx, ctx - q_len + q0 + BLOCK_Q)  # past the tile's last query position
    lo = 0
    if WINDOW:
        lo = tl.maximum(ctx - q_len + q0 - window + 1, 0)
    m_i = tl.full([BLOCK_Q * G_PAD], NEG, tl.float32)
    l_i = tl.zeros([BLOCK_Q * G_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * G_PAD, BLOCK_D], tl.float32)
    for start in range((lo // TILE_N) * TILE_N, hi, TILE_N):
        pos = start + tl.arange(0, TILE_N)
        valid = pos < hi
        k, v = _tile_kv(kc_ptr, vc_ptr, ks_ptr, vs_ptr, tables_ptr + b * stride_tb, pos, valid, kvh, d, stride_cb,
                        stride_cs, stride_ch, stride_sb, stride_ss, BLOCK_SIZE, HEAD_DIM, QUANT)
        s = _scores(q, k, scale, softcap, DOT_F32, SOFTCAP)
        seen = valid[None, :] & (pos[None, :] <= q_pos[:, None])
        if WINDOW:
            seen = seen & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(seen, s, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(m_i, l_i, acc, s, v, q, DOT_F32)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + (q_start + tok)[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=q_mask)


def prefill_block_q(group: int) -> int:
    """Query rows per prefill tile: about 128 rows (query rows x the group's heads) a tile product."""
    return max(16, 128 // triton.next_power_of_2(group))


def prefill_tiles(query_start_loc: list[int], first_seq: int, block_q: int) -> tuple[list[int], list[int]]:
    """Each prefill tile's sequence (indexed from `first_seq`) and first query row within it."""
    seqs, q0s = [], []
    for i, b in enumerate(range(first_seq, len(query_start_loc) - 1)):
        n = query_start_loc[b + 1] - query_start_loc[b]
        for q0 in range(0, n, block_q):
            seqs.append(i)
            q0s.append(q0)
    return seqs, q0s


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                  lens: torch.Tensor, starts: torch.Tensor, tile_seq: torch.Tensor, tile_q0: torch.Tensor,
                  scale: float, out: torch.Tensor, *, block_q: int, window: int | None = None,
                  softcap: float | None = None, k_scales: torch.Tensor | None = None,
                  v_scales: torch.Tensor | None = None, tile_n: int = 64) -> None:
    """Prefill chunks: sequence i's query rows are q[starts[i]:starts[i + 1]], the last of the lens[i]
    positions of its context (block table tables[i]); the tiles (tile_seq, tile_q0) are
    `prefill_tiles(..., block_q)`'s. Writes those rows of out."""
    if tile_seq.numel() == 0:
        return
    _, hq, dim = q.shape
    hk = k_cache.shape[2]
    group = hq // hk
    quant = k_scales is not None
    ks, vs, stride_sb, stride_ss = _scale_args(k_scales, v_scales, lens)
    _prefill_kernel[(tile_seq.numel(), hk)](
        q, k_cache, v_cache, ks, vs, tables, lens, starts, tile_seq, tile_q0, out,
        scale, softcap or 1.0, window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), stride_sb, stride_ss, tables.stride(0),
        GROUP=group, G_PAD=triton.next_power_of_2(group), BLOCK_Q=block_q, HEAD_DIM=dim,
        BLOCK_D=max(16, triton.next_power_of_2(dim)), BLOCK_SIZE=k_cache.shape[1], TILE_N=tile_n, QUANT=quant,
        SOFTCAP=softcap is not None, WINDOW=window is not None, DOT_F32=_dot_f32(q),
        num_warps=8 if block_q * triton.next_power_of_2(group) >= 128 else 4,  # 128-row tiles: 8 warps hold them
        **pdl_args(q.device))


def _scale_args(k_scales: torch.Tensor | None, v_scales: torch.Tensor | None, unread: torch.Tensor,
                ) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """The scale tensors and their block and slot strides; without scales, a placeholder no kernel reads."""
    if k_scales is None or v_scales is None:
        return unread, unread, 0, 0
    return k_scales, v_scales, k_scales.stride(0), k_scales.stride(1)


def _dot_f32(q: torch.Tensor) -> bool:
    return q.dtype == torch.float32 or interpreting()
