"""Every fast attention path against the torch_ref oracle, on random paged caches: decodes and
prefill chunks, with and without earlier context, GQA ratios, sliding windows, dtypes."""

from __future__ import annotations

import random

import pytest
import torch
from torch.nn.attention import SDPBackend

from tokenmill.attention import get_backend
from tokenmill.attention.backend import AttentionMetadata, output_rows
from tokenmill.attention.cpu import CUDA_SDPA_BACKENDS, SDPA_PREFILL_MIN_CONTEXT
from tokenmill.kernels import load_cpu_kernels


def make_batch(seed: int, query_lens: list[int], ctx_lens: list[int], block_size: int, num_blocks: int,
               window: int | None) -> AttentionMetadata:
    rng = random.Random(seed)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables, qsl = [], [0]
    for q, c in zip(query_lens, ctx_lens):
        n = -(-c // block_size)
        tables.append([free.pop() for _ in range(n)])
        qsl.append(qsl[-1] + q)
    return AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), query_start_loc=qsl,
                             seq_lens=ctx_lens, block_tables=tables,
                             num_decodes=sum(1 for q in query_lens if q == 1), block_size=block_size,
                             sliding_window=window)


@pytest.mark.parametrize("backend", ["sdpa", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hk,dim", [(4, 4, 32), (8, 2, 64), (12, 4, 64), (4, 1, 16), (8, 2, 128)])
@pytest.mark.parametrize("window", [None, 7, 40])
def test_matches_reference(backend: str, dtype: torch.dtype, hq: int, hk: int, dim: int, window: int | None) -> None:
    check_against_reference(backend, dtype, hq, hk, dim, window, torch.device("cpu"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the lent device)")
@pytest.mark.parametrize("window", [None, 7])
def test_sdpa_on_cuda_matches_reference(window: int | None) -> None:
    check_against_reference("cuda", torch.bfloat16, 12, 4, 64, window, torch.device("cuda"))


def test_cuda_sdpa_leaves_out_cudnn() -> None:
    # cuDNN's SDPA builds a plan per new shape (45-72 ms each on an H100): ~35 s of a first run
    assert SDPBackend.CUDNN_ATTENTION not in CUDA_SDPA_BACKENDS
    assert SDPBackend.FLASH_ATTENTION in CUDA_SDPA_BACKENDS and SDPBackend.MATH in CUDA_SDPA_BACKENDS


def check_against_reference(backend: str, dtype: torch.dtype, hq: int, hk: int, dim: int, window: int | None,
                            device: torch.device) -> None:
    # decodes first (query length 1), then prefill chunks with and without earlier context
    meta, q, k_new, v_new, k_cache, v_cache = random_step(1, [1, 1, 1, 1, 9, 17, 5], [1, 13, 40, 57, 9, 30, 5],
                                                          hq, hk, dim, window, dtype)
    ref = get_backend("torch_ref")
    fast = get_backend(backend)
    fast.prepare(meta, device)
    expected = ref.forward(q, k_new, v_new, k_cache, v_cache, meta, dim**-0.5)
    args = [t.to(device) for t in (q, k_new, v_new, k_cache, v_cache)]
    got = fast.forward(*args, meta, dim**-0.5).cpu()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("backend", ["torch_ref", "sdpa", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 7])
def test_output_rows_attend_as_in_the_whole_step(backend: str, dtype: torch.dtype, window: int | None) -> None:
    # some rows of a step (last rows of chunks, a middle row, decodes, out of order), attended as
    # single queries over output_rows' meta, give those rows' outputs of the whole step
    dim = 64
    meta, q, k_new, v_new, k_cache, v_cache = random_step(2, [1, 1, 9, 17, 5], [13, 40, 9, 30, 5], 8, 2, dim,
                                                          window, dtype)
    meta.slot_mapping = torch.arange(q.shape[0])
    ref = get_backend("torch_ref")
    whole = ref.forward(q, k_new, v_new, k_cache, v_cache, meta, dim**-0.5)
    rows, seqs = [10, 1, 32, 0, 27, 20], [2, 1, 4, 0, 3, 3]  # 20: a middle row of the 17-token chunk
    sub = output_rows(meta, rows, seqs)
    assert sub.meta.seq_lens == [9, 40, 5, 13, 30, 23] and sub.meta.num_decodes == len(rows)
    assert sub.meta.slot_mapping.tolist() == rows
    fast = get_backend(backend)
    fast.prepare(sub.meta, torch.device("cpu"))
    idx = sub.index
    got = fast.forward(q[idx], k_new[idx], v_new[idx], k_cache, v_cache, sub.meta, dim**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), whole[idx].float(), atol=tol, rtol=tol)


Step = tuple[AttentionMetadata, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def random_step(seed: int, query_lens: list[int], ctx_lens: list[int], hq: int, hk: int, dim: int,
                window: int | None, dtype: torch.dtype) -> Step:
    """A step over random paged caches of 64 blocks of 8 tokens: (meta, q, k_new, v_new, k_cache,
    v_cache), this step's k/v being the last query_len positions of each sequence's cached context."""
    torch.manual_seed(0)
    bs, num_blocks = 8, 64
    meta = make_batch(seed, query_lens, ctx_lens, bs, num_blocks, window)
    k_cache = torch.randn(num_blocks, bs, hk, dim, dtype=dtype)
    v_cache = torch.randn(num_blocks, bs, hk, dim, dtype=dtype)
    q = torch.randn(sum(query_lens), hq, dim, dtype=dtype)
    k_new = torch.cat([_ctx(k_cache, meta, b)[c - n:] for b, (n, c) in enumerate(zip(query_lens, ctx_lens))])
    v_new = torch.cat([_ctx(v_cache, meta, b)[c - n:] for b, (n, c) in enumerate(zip(query_lens, ctx_lens))])
    return meta, q, k_new, v_new, k_cache, v_cache


def _ctx(cache: torch.Tensor, meta: AttentionMetadata, b: int) -> torch.Tensor:
    idx = torch.tensor(meta.block_tables[b])
    return cache.index_select(0, idx).flatten(0, 1)[: meta.seq_lens[b]]


def test_cpu_kernel_builds_here() -> None:
    # CI runs on a machine with a C++ compiler: the fast path must really be exercised there
    assert load_cpu_kernels() is not None


@pytest.mark.parametrize("backend", ["sdpa", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 7])
def test_soft_capped_scores_match_reference(backend: str, dtype: torch.dtype, window: int | None) -> None:
    """Gemma 2's cap * tanh(scores / cap), which SDPA and the C++ kernels do not do: their backends take
    the written-out arithmetic for such a layer, in one step with a layer of another window and no cap."""
    dim, cap = 64, 2.0
    meta, q, k_new, v_new, k_cache, v_cache = random_step(3, [1, 1, 1, 9, 17, 5], [1, 13, 40, 9, 30, 5], 8, 2,
                                                          dim, None, dtype)
    q = q * 4  # scores well past the cap
    ref, fast = get_backend("torch_ref"), get_backend(backend)
    fast.prepare(meta, torch.device("cpu"))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    capped = meta.for_layer(window, cap)
    expected = ref.forward(q, k_new, v_new, k_cache, v_cache, capped, dim**-0.5)
    uncapped = ref.forward(q, k_new, v_new, k_cache, v_cache, meta.for_layer(9, None), dim**-0.5)
    assert not torch.allclose(expected.float(), uncapped.float(), atol=0.1)  # the cap changes the output
    for layer_meta, want in ((capped, expected), (meta.for_layer(9, None), uncapped)):
        got = fast.forward(q, k_new, v_new, k_cache, v_cache, layer_meta, dim**-0.5)
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("window", [None, 300])
@pytest.mark.parametrize("sdpa_prefill", [False, True], ids=["kernel-prefill", "sdpa-prefill"])
def test_cpu_backend_long_context_prefill_matches_reference(window: int | None, sdpa_prefill: bool) -> None:
    # a step whose prefill reaches SDPA_PREFILL_MIN_CONTEXT: with sdpa_prefill (the default where AMX-BF16
    # runs) its chunks go through SDPA, the decodes through the C++ decode kernel; without, the C++ prefill
    # kernel takes every chunk. Both against torch_ref, in bf16
    query_lens, ctx_lens = [1, 1, 40, 300, 7], [1100, 50, SDPA_PREFILL_MIN_CONTEXT + 96, 300, 7]
    hq, hk, dim, bs, num_blocks = 12, 4, 64, 16, 256
    torch.manual_seed(0)
    meta = make_batch(3, query_lens, ctx_lens, bs, num_blocks, window)
    k_cache = torch.randn(num_blocks, bs, hk, dim, dtype=torch.bfloat16)
    v_cache = torch.randn(num_blocks, bs, hk, dim, dtype=torch.bfloat16)
    q = torch.randn(sum(query_lens), hq, dim, dtype=torch.bfloat16)
    k_new = torch.cat([_ctx(k_cache, meta, b)[c - n:] for b, (n, c) in enumerate(zip(query_lens, ctx_lens))])
    v_new = torch.cat([_ctx(v_cache, meta, b)[c - n:] for b, (n, c) in enumerate(zip(query_lens, ctx_lens))])
    fast = get_backend("cpu")
    fast.sdpa_prefill = sdpa_prefill
    calls: list[str] = []
    kernel = fast.ops.prefill_attention
    kernel_built = bool(fast.ops.has_prefill_kernel(dim))

    def counting(*args: object) -> object:
        calls.append("kernel")
        return kernel(*args)

    fast.ops = _Ops(fast.ops, prefill_attention=counting)
    fast.prepare(meta, torch.device("cpu"))
    expected = get_backend("torch_ref").forward(q, k_new, v_new, k_cache, v_cache, meta, dim**-0.5)
    got = fast.forward(q, k_new, v_new, k_cache, v_cache, meta, dim**-0.5)
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)
    # the prefill kernel is built for AVX512-BF16; without it every chunk goes through SDPA
    assert calls == ([] if sdpa_prefill or not kernel_built else ["kernel"])


class _Ops:
    """The kernels' ops with some replaced (torch's op namespaces take no attribute assignment)."""

    def __init__(self, ops: object, **replaced: object) -> None:
        self._ops, self._replaced = ops, replaced

    def __getattr__(self, name: str) -> object:
        return self._replaced[name] if name in self._replaced else getattr(self._ops, name)
