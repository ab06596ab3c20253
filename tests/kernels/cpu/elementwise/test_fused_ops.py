"""The fused C++ elementwise ops (kernels/cpu/elementwise), bf16 and float32, against the torch reference path
they replace, and a bf16 model run with and without the C++ kernels (vLLM's rule where float order differs:
each token in the other's top-k); a float32 model's layers take them too."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import random_prompts
from tokenmill import LLM, SamplingParams
from tokenmill.arch import RopeConfig
from tokenmill.kernels import load_cpu_kernels
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import RotaryEmbedding

OPS = load_cpu_kernels()
pytestmark = pytest.mark.skipif(OPS is None, reason="C++ kernels unavailable")
ULP = 2**-7  # one bf16 ulp at magnitude 1


@pytest.mark.parametrize("rows,dim", [(1, 64), (37, 768), (300, 96)])
def test_rms_norm(rows: int, dim: int) -> None:
    torch.manual_seed(rows)
    norm = RMSNorm(dim, 1e-6).to(torch.bfloat16)
    norm.weight.data.normal_(1.0, 0.2)
    x = (torch.randn(rows, dim) * 3).bfloat16()
    res = torch.randn(rows, dim).bfloat16()
    expected = norm(x)
    exp_out, exp_res = norm(x, res.clone())
    norm.ops = OPS
    got = norm(x)
    got_out, got_res = norm(x, res.clone())
    torch.testing.assert_close(got, expected, atol=4 * ULP, rtol=ULP)
    torch.testing.assert_close(got_res, exp_res, atol=0, rtol=0)
    torch.testing.assert_close(got_out, exp_out, atol=4 * ULP, rtol=ULP)
    assert (got == expected).float().mean() > 0.99  # rounding ties aside, bitwise equal


def test_silu_and_mul() -> None:
    x = (torch.randn(19, 2 * 160) * 4).bfloat16()
    gate, up = x.split(160, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(OPS.silu_and_mul(x), expected, atol=ULP, rtol=ULP)


@pytest.mark.parametrize("theta", [10000.0, 500000.0])
def test_rotary_in_place_on_strided_views(theta: float) -> None:
    rope = RotaryEmbedding(64, 512, RopeConfig(theta=theta), torch.bfloat16)
    qkv = torch.randn(23, (8 + 2 * 2) * 64).bfloat16()
    q = qkv[:, : 8 * 64].view(23, 8, 64)
    k = qkv[:, 8 * 64: 10 * 64].view(23, 2, 64)
    positions = torch.randint(0, 512, (23,))
    exp_q, exp_k = rope(positions, q.clone(), k.clone())
    rope.ops = OPS
    got_q, got_k = rope(positions, q, k)
    torch.testing.assert_close(got_q, exp_q, atol=ULP, rtol=ULP)
    torch.testing.assert_close(got_k, exp_k, atol=ULP, rtol=ULP)
    assert got_q.data_ptr() == q.data_ptr()  # rotated in place


@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_float32(residual: bool) -> None:
    torch.manual_seed(3)
    norm = RMSNorm(96, 1e-6)
    norm.weight.data.normal_(1.0, 0.2)
    x, res = torch.randn(37, 96) * 3, torch.randn(37, 96)
    expected = norm(x, res.clone()) if residual else norm(x)
    norm.ops, norm.fused_dtypes = OPS, (torch.float32,)
    got = norm(x, res.clone()) if residual else norm(x)
    if residual:
        torch.testing.assert_close(got[1], expected[1], atol=0, rtol=0)  # x + residual, the same float add
        got, expected = got[0], expected[0]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_silu_and_mul_float32() -> None:
    x = torch.randn(19, 2 * 160) * 4
    gate, up = x.split(160, dim=-1)
    torch.testing.assert_close(OPS.silu_and_mul(x), torch.nn.functional.silu(gate) * up, atol=1e-5, rtol=1e-5)


def test_rotary_float32_in_place() -> None:
    rope = RotaryEmbedding(64, 512, RopeConfig(theta=10000.0), torch.float32)
    qkv = torch.randn(23, 12 * 64)
    q, k = qkv[:, : 8 * 64].view(23, 8, 64), qkv[:, 8 * 64: 10 * 64].view(23, 2, 64)
    positions = torch.randint(0, 512, (23,))
    exp_q, exp_k = rope(positions, q.clone(), k.clone())
    rope.ops, rope.fused_dtypes = OPS, (torch.float32,)
    got_q, got_k = rope(positions, q, k)
    torch.testing.assert_close(got_q, exp_q, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got_k, exp_k, atol=1e-6, rtol=1e-5)
    assert got_q.data_ptr() == q.data_ptr()  # rotated in place


def test_float32_model_takes_the_fused_ops(llama_dir: str) -> None:
    llm = LLM(llama_dir, dtype="float32", kv_cache_memory="4MiB")
    model = llm.engine.core.executor.worker.model
    taken = [m for m in model.modules() if isinstance(m, (RMSNorm, RotaryEmbedding)) and m.ops is not None]
    assert taken and all(m.fused_dtypes == (torch.float32,) for m in taken)
    off = LLM(llama_dir, dtype="float32", kv_cache_memory="4MiB", cpu_kernels=False)
    assert all(m.ops is None for m in off.engine.core.executor.worker.model.modules()
               if isinstance(m, (RMSNorm, RotaryEmbedding)))


def test_bf16_model_with_and_without_kernels(llama_dir: str) -> None:
    prompts = random_prompts(6, 5, 40, seed=5)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
    runs = [LLM(llama_dir, dtype="bfloat16", kv_cache_memory="4MiB", cpu_kernels=flag)
            .generate(prompts, params, use_tqdm=False) for flag in (True, False)]
    for fast, ref in zip(*runs):
        a, b = fast.outputs[0], ref.outputs[0]
        for i, (ta, tb) in enumerate(zip(a.token_ids, b.token_ids)):
            if ta != tb:  # float order differs: each must be in the other's top-5, then stop
                assert a.logprobs is not None and b.logprobs is not None
                assert ta in b.logprobs[i] and tb in a.logprobs[i]
                break


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_write_kv_matches_index_put(dtype: torch.dtype) -> None:
    from tokenmill.attention.backend import write_kv

    torch.manual_seed(0)
    hk, dim, t = 2, 16, 11
    qkv = torch.randn(t, (4 + 2 * hk) * dim).to(dtype)  # strided k/v rows, as the model splits them
    _, k, v = qkv.split([4 * dim, hk * dim, hk * dim], dim=-1)
    k, v = k.view(t, hk, dim), v.view(t, hk, dim)
    slots = torch.randperm(6 * 8)[:t]
    expected = [torch.zeros(6, 8, hk, dim, dtype=dtype) for _ in range(2)]
    got = [torch.zeros(6, 8, hk, dim, dtype=dtype) for _ in range(2)]
    write_kv(k, v, expected[0], expected[1], slots)
    OPS.write_kv_(k, v, got[0], got[1], slots)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    with pytest.raises(RuntimeError, match="out of range"):
        OPS.write_kv_(k, v, got[0], got[1], torch.full((t,), 6 * 8))
