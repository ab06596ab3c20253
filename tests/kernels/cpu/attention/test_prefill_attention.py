"""The C++ prefill attention kernel (kernels/cpu/attention/prefill_attention.cpp, via the `cpu` backend)
against the torch_ref oracle, on what tests/attention/test_backends leaves out: the engine's block size,
prompts spanning many blocks, several prompts per call, chunks after a long context, windows smaller
than the chunk, head sizes 32/64/128, wide GQA groups and query lengths that do not fill the kernel's
tiles."""

from __future__ import annotations

import pytest
import torch

from tests.attention.test_backends import _ctx, make_batch
from tokenmill.attention import get_backend
from tokenmill.attention.cpu import CpuBackend
from tokenmill.kernels import load_cpu_kernels


def _kernel_applies(dim: int) -> bool:
    ops = load_cpu_kernels()
    return ops is not None and bool(ops.has_prefill_kernel(dim))


@pytest.fixture(params=[True, False], ids=["amx", "dpbf16"])
def amx(request: pytest.FixtureRequest) -> bool:
    """The kernel's AMX-BF16 path where it runs, and its VDPBF16PS products (everywhere else's path)."""
    ops = load_cpu_kernels()
    if request.param and (ops is None or not ops.has_prefill_amx()):
        pytest.skip("no AMX-BF16 path in the prefill kernel here")
    return bool(request.param)


def _compare(query_lens: list[int], ctx_lens: list[int], hq: int, hk: int, dim: int, window: int | None,
             block_size: int = 16, seed: int = 0, strided_q: bool = False, amx: bool = False) -> None:
    if not _kernel_applies(dim):
        pytest.skip("no AVX512-BF16 prefill kernel on this CPU")
    torch.manual_seed(seed)
    num_blocks = sum(-(-c // block_size) for c in ctx_lens) + 3
    meta = make_batch(seed, query_lens, ctx_lens, block_size, num_blocks, window)
    k_cache = torch.randn(num_blocks, block_size, hk, dim, dtype=torch.bfloat16)
    v_cache = torch.randn(num_blocks, block_size, hk, dim, dtype=torch.bfloat16)
    q = torch.randn(sum(query_lens), hq, dim, dtype=torch.bfloat16)
    if strided_q:  # as the model passes it: the q part of a fused qkv projection's rows
        qkv = torch.randn(q.shape[0], (hq + 2 * hk) * dim, dtype=torch.bfloat16)
        qkv[:, : hq * dim] = q.flatten(1)
        q = qkv[:, : hq * dim].view(-1, hq, dim)
        assert not q.is_contiguous()
    k_new = torch.cat([_ctx(k_cache, meta, b)[c - n:] for b, (n, c) in enumerate(zip(query_lens, ctx_lens))])
    v_new = torch.cat([_ctx(v_cache, meta, b)[c - n:] for b, (n, c) in enumerate(zip(query_lens, ctx_lens))])
    fast = CpuBackend()
    fast.sdpa_prefill = False  # the C++ kernel at every context, also where AMX-BF16 would route long ones to SDPA
    fast.prefill_amx = amx
    fast.prepare(meta, torch.device("cpu"))
    assert "prefill_tables" in meta.extra and fast._has_prefill_kernel(q)  # the kernel, not the SDPA fallback
    expected = get_backend("torch_ref").forward(q, k_new, v_new, k_cache, v_cache, meta, dim**-0.5)
    got = fast.forward(q, k_new, v_new, k_cache, v_cache, meta, dim**-0.5)
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dim", [32, 64, 128])
@pytest.mark.parametrize("hq,hk", [(12, 4), (32, 4), (8, 8), (24, 2)])
def test_several_prompts_one_call(hq: int, hk: int, dim: int, amx: bool) -> None:
    # fresh prompts of lengths around the tile size (48 query rows) and block boundaries
    _compare([1, 5, 16, 17, 47, 49, 130], [9, 5, 16, 17, 47, 49, 130], hq, hk, dim, None, amx=amx)


@pytest.mark.parametrize("window", [None, 5, 100, 700])
def test_long_prompt(window: int | None, amx: bool) -> None:
    _compare([613], [613], 12, 4, 64, window, amx=amx)


@pytest.mark.parametrize("window", [None, 30, 333])
@pytest.mark.parametrize("block_size", [16, 32, 5])
def test_chunk_after_long_context(window: int | None, block_size: int, amx: bool) -> None:
    # decodes first, then a chunk of 200 rows after 1,000 cached tokens and a short fresh prompt
    _compare([1, 1, 200, 37], [70, 1200, 1200, 37], 12, 4, 64, window, block_size, amx=amx)


def test_strided_q_as_split_from_qkv(amx: bool) -> None:
    # decodes and prefill chunks read q in place from the qkv rows (no contiguous copy)
    _compare([1, 1, 200, 37], [70, 300, 300, 37], 12, 4, 64, None, strided_q=True, amx=amx)


def test_window_smaller_than_chunk_wide_group(amx: bool) -> None:
    _compare([3, 90, 250], [500, 90, 260], 32, 4, 128, 17, amx=amx)


def test_large_scores_stay_finite(amx: bool) -> None:
    # a query aligned with its keys gives scores in the hundreds: the online softmax must rescale
    if not _kernel_applies(64):
        pytest.skip("no AVX512-BF16 prefill kernel on this CPU")
    meta = make_batch(0, [64], [64], 16, 4, None)
    k_cache = torch.randn(4, 16, 1, 64).mul(4).to(torch.bfloat16)
    v_cache = torch.randn(4, 16, 1, 64, dtype=torch.bfloat16)
    k = _ctx(k_cache, meta, 0)
    q = k.repeat(1, 2, 1).contiguous()
    fast = CpuBackend()
    fast.prefill_amx = amx
    fast.prepare(meta, torch.device("cpu"))
    got = fast.forward(q, k, _ctx(v_cache, meta, 0), k_cache, v_cache, meta, 0.125)
    expected = get_backend("torch_ref").forward(q, k, k, k_cache, v_cache, meta, 0.125)
    assert torch.isfinite(got.float()).all()
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)
