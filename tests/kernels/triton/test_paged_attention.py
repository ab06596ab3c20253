"""The Triton attention kernels (through the `triton` backend) against the torch_ref oracle: on the CPU under
Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 where no GPU is present), on the GPU where
one is. Small shapes: block sizes 16 and 32, GQA ratios 1, 4 and 8, sliding windows, soft-capped scores,
prefixes that end inside a block, decodes split over their context, a quantized cache."""

from __future__ import annotations

import random

import pytest
import torch

from tokenmill.attention import get_backend
from tokenmill.attention.backend import AttentionMetadata, KVScales
from tokenmill.kernels.triton import paged_attention as pa

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DIM = 32
# decodes first (contexts 1, 23, 70: past two tiles of 32), then prefill chunks: a whole prompt (9 of 9),
# a chunk after a prefix that ends inside a block (17 after 19), a chunk of 5 after 40
QUERY_LENS = [1, 1, 1, 9, 17, 5]
CTX_LENS = [1, 23, 70, 9, 36, 45]


def random_step(seed: int, block_size: int, hq: int, hk: int, dtype: torch.dtype, window: int | None,
                softcap: float | None = None) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(meta, q, keys, values): each sequence's whole context as keys/values, its last rows as queries."""
    rng = random.Random(seed)
    num_blocks = sum(-(-c // block_size) for c in CTX_LENS) + 3
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables, qsl, slots = [], [0], []
    for n, c in zip(QUERY_LENS, CTX_LENS):
        tables.append([free.pop() for _ in range(-(-c // block_size))])
        qsl.append(qsl[-1] + n)
        slots.append([tables[-1][p // block_size] * block_size + p % block_size for p in range(c)])
    meta = AttentionMetadata(slot_mapping=torch.tensor([s for row in slots for s in row]), query_start_loc=qsl,
                             seq_lens=list(CTX_LENS), block_tables=tables, num_decodes=3, block_size=block_size,
                             sliding_window=window, softcap=softcap)
    gen = torch.Generator().manual_seed(seed)
    total = sum(CTX_LENS)
    keys = torch.randn(total, hk, DIM, generator=gen).to(dtype)
    values = torch.randn(total, hk, DIM, generator=gen).to(dtype)
    q = (torch.randn(sum(QUERY_LENS), hq, DIM, generator=gen) * (3 if softcap else 1)).to(dtype)
    return meta, q, keys, values


def caches(meta: AttentionMetadata, keys: torch.Tensor, values: torch.Tensor, dtype: torch.dtype,
           backend: str) -> tuple[torch.Tensor, torch.Tensor, KVScales | None]:
    """Empty caches of `dtype` with every context position written by the backend's own write_kv."""
    nb = 1 + max(b for t in meta.block_tables for b in t)
    shape = (nb, meta.block_size, keys.shape[1], DIM)
    kc = torch.zeros(shape, dtype=dtype, device=DEVICE)
    vc = torch.zeros(shape, dtype=dtype, device=DEVICE)
    scales = None
    if dtype in (torch.int8, torch.float8_e4m3fn):
        scales = KVScales(torch.zeros(shape[:3], device=DEVICE), torch.zeros(shape[:3], device=DEVICE))
    get_backend(backend).write_kv(keys.to(DEVICE), values.to(DEVICE), kc, vc, meta.slot_mapping.to(DEVICE), scales)
    return kc, vc, scales


def attend(backend: str, meta: AttentionMetadata, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
           scales: KVScales | None) -> torch.Tensor:
    impl = get_backend(backend)
    impl.prepare(meta, DEVICE)
    rows = torch.empty(q.shape[0], q.shape[1] // kc.shape[2], DIM)  # this step's k/v: unused by both
    out = impl.forward(q.to(DEVICE), rows, rows, kc, vc, meta, DIM**-0.5, scales)
    return out.float().cpu()


@pytest.mark.parametrize("block_size,hq,hk,window", [(16, 4, 4, None), (32, 4, 4, 12), (16, 8, 2, 12),
                                                     (32, 8, 2, None), (16, 8, 1, None), (32, 8, 1, 12)])
def test_matches_reference(block_size: int, hq: int, hk: int, window: int | None) -> None:
    meta, q, keys, values = random_step(block_size + hq + hk, block_size, hq, hk, torch.float32, window)
    kc, vc, _ = caches(meta, keys, values, torch.float32, "triton")
    ref_kc, ref_vc, _ = caches(meta, keys, values, torch.float32, "torch_ref")
    assert torch.equal(kc, ref_kc) and torch.equal(vc, ref_vc)  # the Triton store writes what torch's does
    want = attend("torch_ref", meta, q, ref_kc, ref_vc, None)
    torch.testing.assert_close(attend("triton", meta, q, kc, vc, None), want, atol=1e-5, rtol=1e-5)


def test_soft_capped_bf16_matches_reference() -> None:
    window = 12
    meta, q, keys, values = random_step(5, 16, 8, 2, torch.bfloat16, window, softcap=2.0)
    kc, vc, _ = caches(meta, keys, values, torch.bfloat16, "triton")
    want = attend("torch_ref", meta, q, kc, vc, None)
    uncapped = attend("torch_ref", meta.for_layer(window, None), q, kc, vc, None)
    assert not torch.allclose(want, uncapped, atol=0.1)  # the cap matters here
    torch.testing.assert_close(attend("triton", meta, q, kc, vc, None), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("qdtype", [torch.int8, torch.float8_e4m3fn])
def test_quantized_cache_matches_reference(qdtype: torch.dtype) -> None:
    meta, q, keys, values = random_step(6, 16, 8, 2, torch.float32, 12)
    kc, vc, scales = caches(meta, keys, values, qdtype, "triton")
    want = attend("torch_ref", meta, q, kc, vc, scales)
    torch.testing.assert_close(attend("triton", meta, q, kc, vc, scales), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("splits,window", [(1, None), (8, None), (8, 20), (64, None)])
def test_decode_splits_combine_to_one_softmax(splits: int, window: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    # any split of the context gives the same output; a row of length 0 (a padded CUDA-graph row) gives 0;
    # splits past a short context's tiles write nothing and the combine reads none of them (the partial
    # buffers start as NaN here, so a read of one would show)
    meta, q, keys, values = random_step(7, 16, 8, 2, torch.float32, window)
    kc, vc, _ = caches(meta, keys, values, torch.float32, "triton")
    want = attend("torch_ref", meta, q, kc, vc, None)[:3]
    tables = torch.tensor([t + [0] * (5 - len(t)) for t in meta.block_tables[:3]] + [[0] * 5], dtype=torch.int32)
    lens = torch.tensor(CTX_LENS[:3] + [0], dtype=torch.int32)
    out = torch.full((4, 8, DIM), 7.0, device=DEVICE)
    qd = torch.cat([q[:3], q[:1]]).to(DEVICE)
    full = torch.full
    monkeypatch.setattr(torch, "empty", lambda *size, dtype=None, device=None: full(size, float("nan"), dtype=dtype,
                                                                                     device=device))
    pa.paged_decode(qd, kc, vc, tables.to(DEVICE), lens.to(DEVICE), DIM**-0.5, out, num_splits=splits, tile_n=16,
                    window=window)
    torch.testing.assert_close(out[:3].cpu(), want, atol=1e-5, rtol=1e-5)
    assert (out[3] == 0).all()


def test_store_skips_negative_slots() -> None:
    kc = torch.zeros(2, 4, 2, DIM, device=DEVICE)
    vc = torch.zeros_like(kc)
    k = torch.randn(3, 2, DIM, device=DEVICE)
    pa.store_kv(k, -k, kc, vc, torch.tensor([5, -1, 2], device=DEVICE))
    assert torch.equal(kc[1, 1], k[0]) and torch.equal(kc[0, 2], k[2]) and torch.equal(vc[1, 1], -k[0])
    assert int((kc != 0).any(-1).any(-1).sum()) == 2  # the -1 row wrote nothing


def test_prefill_tiles_cover_every_query_row() -> None:
    seqs, q0s = pa.prefill_tiles([0, 1, 2, 19, 20, 53], 2, 16)
    assert list(zip(seqs, q0s)) == [(0, 0), (0, 16), (1, 0), (2, 0), (2, 16), (2, 32)]
    assert pa.decode_splits(1, 4, 2048, 64) == 16 and pa.decode_splits(256, 8, 2048, 64) == 1
