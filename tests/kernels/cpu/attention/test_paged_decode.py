"""The C++ paged decode kernel (kernels/cpu/attention/paged_decode.cpp) against the torch_ref oracle on
what the backend tests leave out: engine-sized blocks, long contexts over many blocks, lengths off the
16-key tile, GQA groups from 1 to 16, head size 128, blocks of other sizes, strided q (a split of a
fused qkv projection), and cache slots past a context that hold NaN and must not be read."""

from __future__ import annotations

import random

import pytest
import torch

from tokenmill.attention import get_backend
from tokenmill.attention.backend import AttentionMetadata
from tokenmill.kernels import load_cpu_kernels

OPS = load_cpu_kernels()
pytestmark = pytest.mark.skipif(OPS is None, reason="C++ CPU kernels unavailable")


def _batch(ctx_lens: list[int], block_size: int, hk: int, dim: int, dtype: torch.dtype, seed: int
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Random caches whose blocks are shuffled over the pool; slots no context reaches hold NaN."""
    rng = random.Random(seed)
    free = list(range(sum(-(-c // block_size) for c in ctx_lens) + 3))
    rng.shuffle(free)
    k_cache = torch.full((len(free), block_size, hk, dim), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    tables = []
    for c in ctx_lens:
        table = [free.pop() for _ in range(-(-c // block_size))]
        for i, blk in enumerate(table):
            rows = min(block_size, c - i * block_size)
            k_cache[blk, :rows] = torch.randn(rows, hk, dim).to(dtype)
            v_cache[blk, :rows] = torch.randn(rows, hk, dim).to(dtype)
        tables.append(table)
    meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long),
                             query_start_loc=list(range(len(ctx_lens) + 1)), seq_lens=ctx_lens,
                             block_tables=tables, num_decodes=len(ctx_lens), block_size=block_size)
    n_blocks = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (n_blocks - len(t)) for t in tables], dtype=torch.int32)
    return k_cache, v_cache, table, meta


def _check(ctx_lens: list[int], hq: int, hk: int, dim: int, block_size: int = 16, window: int | None = None,
           dtype: torch.dtype = torch.bfloat16, strided_q: bool = False, seed: int = 0) -> None:
    torch.manual_seed(seed)
    k_cache, v_cache, table, meta = _batch(ctx_lens, block_size, hk, dim, dtype, seed)
    meta.sliding_window = window
    b = len(ctx_lens)
    if strided_q:  # q as the first part of a fused [q | k | v] projection: rows are strided
        q = torch.randn(b, (hq + 2 * hk) * dim).to(dtype)[:, : hq * dim].view(b, hq, dim)
        assert not q.is_contiguous()
    else:
        q = torch.randn(b, hq, dim).to(dtype)
    lens = torch.tensor(ctx_lens, dtype=torch.int32)
    scale = dim**-0.5
    got = OPS.paged_decode(q, k_cache, v_cache, table, lens, scale, window or 0)
    empty = torch.empty(0, hk, dim, dtype=dtype)
    expected = get_backend("torch_ref").forward(q, empty, empty, k_cache, v_cache, meta, scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)
    if dtype == torch.bfloat16:
        # over the whole output: the bf16 rounding of the output leaves about 1.2e-3, P rounded to bf16 for
        # the products with V about 0.2e-3 more; a head or a column a few percent off shows
        assert float((got.float() - expected.float()).norm() / expected.float().norm()) < 3e-3


# contexts of 1 to 770 keys: within one tile, off the 16-key tile, exactly on it, over many blocks
CTX = [1, 5, 16, 17, 31, 48, 100, 257, 770]


@pytest.mark.parametrize("hq,hk,dim", [(12, 4, 64), (32, 4, 64), (12, 4, 128), (32, 4, 128), (4, 4, 64),
                                       (16, 1, 64), (10, 2, 32), (6, 1, 128), (8, 2, 64)])
# float32: the AVX2 kernel for head sizes of 64 and 128 (groups of 4 heads and the rest one at a time), the
# generic one for others
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_engine_shapes(hq: int, hk: int, dim: int, dtype: torch.dtype) -> None:
    _check(CTX, hq, hk, dim, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_long_single_context(dtype: torch.dtype) -> None:
    _check([2000], 12, 4, 64, dtype=dtype)


@pytest.mark.parametrize("window", [1, 15, 16, 40, 500])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sliding_window(window: int, dtype: torch.dtype) -> None:
    _check(CTX, 12, 4, 64, window=window, dtype=dtype)


@pytest.mark.parametrize("block_size", [8, 32, 48, 64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_other_block_sizes(block_size: int, dtype: torch.dtype) -> None:
    """Blocks of several 16-row tiles (64: the CPU default) prefetch tile by tile; a window of 70
    starts reading mid-block."""
    _check(CTX, 12, 4, 64, block_size=block_size, window=70 if block_size in (48, 64) else None, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_strided_q(dtype: torch.dtype) -> None:
    _check(CTX, 12, 4, 64, dtype=dtype, strided_q=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_large_scores(dtype: torch.dtype) -> None:
    # scores far apart (a peaked softmax) exercise the rescaling of the running max
    torch.manual_seed(1)
    k_cache, v_cache, table, meta = _batch([300, 40], 16, 2, 64, dtype, 1)
    k_cache.mul_(8)
    q = (torch.randn(2, 4, 64) * 4).to(dtype)
    lens = torch.tensor(meta.seq_lens, dtype=torch.int32)
    got = OPS.paged_decode(q, k_cache, v_cache, table, lens, 0.125, 0)
    empty = torch.empty(0, 2, 64, dtype=dtype)
    expected = get_backend("torch_ref").forward(q, empty, empty, k_cache, v_cache, meta, 0.125)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)
