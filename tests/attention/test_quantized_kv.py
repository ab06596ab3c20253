"""A quantized KV cache (int8 / fp8 e4m3, a float32 scale per token and kv head): the quantizing rule,
the C++ store against it bit for bit, and every backend's attention over the quantized cache against
the reference (torch_ref over the dequantized cache): mixed batches, odd head sizes and block edges."""

from __future__ import annotations

import pytest
import torch

from tests.attention.test_backends import make_batch
from tokenmill.attention import get_backend
from tokenmill.attention.backend import KVScales, check_kv_cache_dtype
from tokenmill.attention.kv_quant import dequantize, quantize, write_kv_quantized
from tokenmill.kernels import load_cpu_kernels

QDTYPES = [torch.int8, torch.float8_e4m3fn]


@pytest.mark.parametrize("qdtype", QDTYPES)
def test_quantize_error_is_within_the_format_step(qdtype: torch.dtype) -> None:
    torch.manual_seed(0)
    x = torch.randn(50, 3, 24) * torch.logspace(-3, 2, 50)[:, None, None]
    x[7, 1] = 0.0  # an all-zero row keeps scale 1 and zeros
    q, s = quantize(x, qdtype)
    assert q.dtype == qdtype and s.shape == (50, 3) and s.dtype == torch.float32
    assert s[7, 1] == 1.0 and (q[7, 1].float() == 0).all()
    err = (dequantize(q, s, torch.float32) - x).abs()
    amax = x.abs().amax(-1, keepdim=True)
    if qdtype == torch.int8:  # half a step of amax / 127
        assert (err <= amax / 127 / 2 * 1.0001 + 1e-12).all()
    else:  # e4m3: 3 mantissa bits, half an ulp relative, or half the smallest subnormal step
        bound = torch.maximum(x.abs() * 2**-4, amax / 448 * 2**-10)
        assert (err <= bound * 1.0001 + 1e-12).all()
    assert q.float().abs().amax() <= (127 if qdtype == torch.int8 else 448)


def quantized_cache(num_blocks: int, bs: int, hk: int, dim: int, qdtype: torch.dtype,
                    ) -> tuple[torch.Tensor, torch.Tensor, KVScales]:
    kc = torch.zeros(num_blocks, bs, hk, dim, dtype=qdtype)
    vc = torch.zeros(num_blocks, bs, hk, dim, dtype=qdtype)
    scales = KVScales(torch.zeros(num_blocks, bs, hk), torch.zeros(num_blocks, bs, hk))
    return kc, vc, scales


@pytest.mark.skipif(load_cpu_kernels() is None, reason="needs the C++ kernels")
@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpp_store_matches_the_torch_rule_bit_for_bit(qdtype: torch.dtype, dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    hk, dim, bs, nb = 3, 20, 5, 9
    qkv = torch.randn(17, 2 * hk + 1, dim, dtype=dtype) * 3
    qkv[4, 0] = 0
    k, v = qkv[:, :hk], qkv[:, hk:2 * hk]  # strided rows, as a split of a fused projection gives them
    slots = torch.randperm(nb * bs)[:17]
    ref, got = quantized_cache(nb, bs, hk, dim, qdtype), quantized_cache(nb, bs, hk, dim, qdtype)
    write_kv_quantized(k, v, ref[0], ref[1], ref[2], slots)
    ops = load_cpu_kernels()
    ops.write_kv_quant_(k, v, got[0], got[1], got[2].k, got[2].v, slots)
    for a, b in ((ref[0], got[0]), (ref[1], got[1])):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert torch.equal(ref[2].k, got[2].k) and torch.equal(ref[2].v, got[2].v)
    with pytest.raises(RuntimeError, match="slot out of range"):
        ops.write_kv_quant_(k, v, got[0], got[1], got[2].k, got[2].v, slots + nb * bs)


def quantized_step(query_lens: list[int], ctx_lens: list[int], hq: int, hk: int, dim: int, bs: int,
                   window: int | None, dtype: torch.dtype, qdtype: torch.dtype):  # type: ignore[no-untyped-def]
    """A step whose whole context was stored quantized: (meta, q, k_new, v_new, quantized caches,
    scales, the dequantized caches in float32)."""
    torch.manual_seed(2)
    nb = 48
    meta = make_batch(3, query_lens, ctx_lens, bs, nb, window)
    kc, vc, scales = quantized_cache(nb, bs, hk, dim, qdtype)
    kf, vf = torch.randn(nb * bs, hk, dim, dtype=dtype) * 2, torch.randn(nb * bs, hk, dim, dtype=dtype)
    write_kv_quantized(kf, vf, kc, vc, scales, torch.arange(nb * bs))
    k_deq = dequantize(kc, scales.k, torch.float32)
    v_deq = dequantize(vc, scales.v, torch.float32)
    q = torch.randn(sum(query_lens), hq, dim, dtype=dtype)
    rows = [torch.tensor(t).repeat_interleave(bs) * bs + torch.arange(bs).repeat(len(t)) for t in meta.block_tables]
    new_slots = torch.cat([r[c - n:c] for r, n, c in zip(rows, query_lens, ctx_lens)])
    k_new, v_new = kf[new_slots], vf[new_slots]
    return meta, q, k_new, v_new, kc, vc, scales, k_deq, v_deq


@pytest.mark.parametrize("backend", ["torch_ref", "sdpa", "cpu"])
@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# the C++ kernel takes a kv head's query heads in runs of up to 4 (head size 64) or 2 (128): groups of 6 and 3
# split into two runs; its integer path (bf16 over int8, head size 64 or 128) reads a tile's scales by permutes
# for 1, 2 or 4 kv heads and by a gather for more (8)
@pytest.mark.parametrize("hq,hk,dim,bs,window", [(8, 2, 64, 8, None), (6, 3, 20, 5, None), (4, 1, 48, 16, 7),
                                                 (4, 4, 128, 3, 40), (12, 2, 64, 16, None), (6, 2, 128, 8, 20),
                                                 (4, 1, 64, 16, None), (16, 8, 64, 16, 30)])
def test_backend_reads_the_quantized_cache_like_the_reference(backend: str, qdtype: torch.dtype, dtype: torch.dtype,
                                                              hq: int, hk: int, dim: int, bs: int,
                                                              window: int | None) -> None:
    # decodes (one at a block edge), then prefill chunks with and without earlier context
    query_lens = [1, 1, 1, 9, 17, 5]
    ctx_lens = [1, 2 * bs, 57, 9, 30, 5 + 3 * bs]
    meta, q, k_new, v_new, kc, vc, scales, k_deq, v_deq = quantized_step(query_lens, ctx_lens, hq, hk, dim, bs,
                                                                         window, dtype, qdtype)
    scale = dim**-0.5
    # the reference: torch_ref over the dequantized cache
    expected = get_backend("torch_ref").forward(q.float(), k_new.float(), v_new.float(), k_deq.view(kc.shape),
                                                 v_deq.view(vc.shape), meta, scale)
    fast = get_backend(backend)
    fast.prepare(meta, torch.device("cpu"))
    got = fast.forward(q, k_new, v_new, kc, vc, meta, scale, scales)
    assert got.dtype == dtype and got.shape == q.shape
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), expected, atol=tol, rtol=tol)
    # over the whole output, bf16 rounding leaves 0.3% at most here; a head a few percent off shows
    assert float((got.float() - expected).norm() / expected.norm()) < (1e-5 if dtype == torch.float32 else 6e-3)


@pytest.mark.skipif(load_cpu_kernels() is None, reason="needs the C++ kernels")
def test_cpu_backend_takes_the_cpp_path_for_a_quantized_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    meta, q, k_new, v_new, kc, vc, scales, _, _ = quantized_step([1, 4], [9, 4], 4, 2, 32, 8, None,
                                                                 torch.bfloat16, torch.int8)
    fast = get_backend("cpu")
    fast.prepare(meta, torch.device("cpu"))

    def no_sdpa(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("the SDPA path ran")

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", no_sdpa)
    fast.forward(q, k_new, v_new, kc, vc, meta, 0.2, scales)
    assert meta.extra["row_lens"].tolist() == [9, 1, 2, 3, 4]


@pytest.mark.skipif(load_cpu_kernels() is None, reason="needs the C++ kernels")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cpu_backend_sends_long_quantized_chunks_past_the_row_kernel(monkeypatch: pytest.MonkeyPatch,
                                                                     dtype: torch.dtype) -> None:
    # a decode, a 70-row chunk and a 3-row one: the long chunk leaves the row-by-row kernel, for the C++ prefill
    # kernel over its dequantized context (bf16, where that kernel is built and the step would not take SDPA for
    # a bf16 cache) or for SDPA over it (float32, or elsewhere)
    meta, q, k_new, v_new, kc, vc, scales, k_deq, v_deq = quantized_step([1, 70, 3], [9, 70, 30], 4, 2, 32, 8, None,
                                                                         dtype, torch.int8)
    sdpa_rows: list[int] = []
    kernel_rows: list[int] = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(query: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        sdpa_rows.append(query.shape[-2])
        return real(query, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    fast = get_backend("cpu")
    real_kernel = fast.ops.prefill_attention

    def kernel_spy(query: torch.Tensor, *args: object) -> None:
        kernel_rows.append(query.shape[0])
        real_kernel(query, *args)

    real_ops = fast.ops

    class SpiedOps:  # the real ops, the prefill kernel's calls counted
        prefill_attention = staticmethod(kernel_spy)

        def __getattr__(self, name: str) -> object:
            return getattr(real_ops, name)

    monkeypatch.setattr(fast, "ops", SpiedOps())
    fast.prepare(meta, torch.device("cpu"))
    got = fast.forward(q, k_new, v_new, kc, vc, meta, 0.2, scales)
    takes_kernel = fast._dequantized_prefill(q, 70)
    assert takes_kernel == (dtype == torch.bfloat16 and bool(load_cpu_kernels().has_prefill_kernel(32))
                            and not fast.sdpa_prefill)
    # the decode and the 3-row chunk stay in the row kernel
    assert (kernel_rows, sdpa_rows) == (([70], []) if takes_kernel else ([], [70]))
    assert meta.extra["quant_rows"].tolist() == [0, 71, 72, 73]
    expected = get_backend("torch_ref").forward(q.float(), k_new.float(), v_new.float(), k_deq.view(kc.shape),
                                                 v_deq.view(vc.shape), meta, 0.2)
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got.float(), expected, atol=tol, rtol=tol)


@pytest.mark.skipif(load_cpu_kernels() is None, reason="needs the C++ kernels")
@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("hq,hk,dim,bs,window", [(8, 2, 64, 8, None), (4, 4, 128, 8, 40), (12, 2, 64, 16, None),
                                                 (6, 2, 128, 8, 20), (4, 1, 32, 16, None)])
def test_long_quantized_chunks_read_like_the_reference(qdtype: torch.dtype, hq: int, hk: int, dim: int, bs: int,
                                                       window: int | None) -> None:
    # long bf16 chunks (the C++ prefill kernel over the dequantized context where it runs): one with its whole
    # context, one after 64 earlier positions, one whose context ends mid-block, beside a decode
    query_lens, ctx_lens = [1, 70, 66, 65], [9, 70, 130, 65 + 2 * bs + 1]
    meta, q, k_new, v_new, kc, vc, scales, k_deq, v_deq = quantized_step(query_lens, ctx_lens, hq, hk, dim, bs,
                                                                         window, torch.bfloat16, qdtype)
    scale = dim**-0.5
    expected = get_backend("torch_ref").forward(q.float(), k_new.float(), v_new.float(), k_deq.view(kc.shape),
                                                 v_deq.view(vc.shape), meta, scale)
    fast = get_backend("cpu")
    fast.prepare(meta, torch.device("cpu"))
    got = fast.forward(q, k_new, v_new, kc, vc, meta, scale, scales)
    torch.testing.assert_close(got.float(), expected, atol=3e-2, rtol=3e-2)
    assert float((got.float() - expected).norm() / expected.norm()) < 6e-3


@pytest.mark.skipif(load_cpu_kernels() is None, reason="needs the C++ kernels")
@pytest.mark.parametrize("dim", [64, 128, 48])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpp_kernel_reads_every_fp8_code_as_its_value(dim: int, dtype: torch.dtype) -> None:
    """Every fp8 e4m3 code (zeros, subnormals, normals, NaN, both signs) read by the C++ kernel as float32's own
    conversion of it: a context of one key, whose V row holds the codes and whose scale is 1, attends with
    weight 1, so the output is that row (head sizes 64 and 128 decode 16 codes at a time in registers, to float32;
    under bf16 queries, 32 at a time to bf16, which holds every e4m3 value exactly)."""
    ops = load_cpu_kernels()
    n = -(-256 // dim) * dim  # every code at least once, in rows of dim
    codes = (torch.arange(n) % 256).to(torch.uint8).view(torch.float8_e4m3fn).view(-1, dim)
    rows = codes.shape[0]
    kc = torch.zeros(rows, 8, 1, dim, dtype=torch.float8_e4m3fn)
    vc = torch.zeros_like(kc)
    vc[:, 0, 0] = codes
    ones = torch.ones(rows, 8, 1)
    got = ops.paged_attention_quant(torch.randn(rows, 2, dim).to(dtype), kc, vc, ones, ones,
                                    torch.arange(rows, dtype=torch.int32)[:, None], torch.ones(rows, dtype=torch.int32),
                                    dim**-0.5, 0)
    expected = codes.float()
    assert got.dtype == dtype
    for h in range(2):
        assert torch.equal(got[:, h].float().isnan(), expected.isnan())
        assert torch.equal(got[:, h].float().nan_to_num(0.0), expected.nan_to_num(0.0))


def test_a_backend_without_quantized_support_is_refused() -> None:
    class Plain:
        name = "plain"
        kv_cache_dtypes: tuple[str, ...] = ()

    with pytest.raises(ValueError, match="'plain' does not support a int8 KV cache"):
        check_kv_cache_dtype(Plain(), "int8")  # type: ignore[arg-type]
    check_kv_cache_dtype(Plain(), "bfloat16")  # type: ignore[arg-type]
    for name in ("torch_ref", "sdpa", "cpu"):
        check_kv_cache_dtype(get_backend(name), "float8_e4m3fn")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the lent device)")
@pytest.mark.parametrize("qdtype", QDTYPES)
def test_sdpa_on_cuda_reads_the_quantized_cache(qdtype: torch.dtype) -> None:
    meta, q, k_new, v_new, kc, vc, scales, k_deq, v_deq = quantized_step([1, 1, 9, 5], [13, 40, 9, 30], 8, 2, 64, 16,
                                                                         None, torch.bfloat16, qdtype)
    expected = get_backend("torch_ref").forward(q.float(), k_new.float(), v_new.float(), k_deq.view(kc.shape),
                                                 v_deq.view(vc.shape), meta, 0.125)
    cuda = torch.device("cuda")
    fast = get_backend("cuda")
    fast.prepare(meta, cuda)
    kc2, vc2, s2 = quantized_cache(kc.shape[0], 16, 2, 64, qdtype)
    kc2, vc2, s2 = kc2.to(cuda), vc2.to(cuda), KVScales(s2.k.to(cuda), s2.v.to(cuda))
    # the store on the GPU too: rewrite the cache from its dequantized values (they quantize to themselves)
    slots = torch.arange(kc.shape[0] * 16, device=cuda)
    fast.write_kv(k_deq.to(cuda), v_deq.to(cuda), kc2, vc2, slots, s2)
    got = fast.forward(q.to(cuda), k_new.to(cuda), v_new.to(cuda), kc2, vc2, meta, 0.125, s2)
    torch.testing.assert_close(got.float().cpu(), expected, atol=3e-2, rtol=3e-2)
