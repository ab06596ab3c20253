"""A quantized KV cache end to end: the spec's bytes and the pool they size, the scales allocated beside
the blocks, and greedy output of the fast backends equal to the reference path's (torch_ref) with the
same quantized cache, across mixed batches, chunked prefill, prefix-cache hits and preemption."""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers

from tests.conftest import random_prompts
from tests.fixtures import greedy_ids, require_fused_decode
from tokenmill import LLM
from tokenmill.kv_cache_spec import FullAttentionSpec, kv_storage_dtype
from tokenmill.layers.attention import attention_layers

PROMPTS = random_prompts(9, 3, 60, seed=1)
MAX_TOKENS = [7, 30, 12, 25, 3, 18, 30, 9, 21]


def test_spec_bytes_count_the_scales() -> None:
    bf16 = FullAttentionSpec(16, "bfloat16", num_kv_heads=2, head_size=64)
    int8 = FullAttentionSpec(16, "int8", num_kv_heads=2, head_size=64)
    fp8 = FullAttentionSpec(16, "float8_e4m3fn", num_kv_heads=2, head_size=64)
    assert bf16.bytes_per_token == 2 * 2 * 64 * 2 and not bf16.quantized
    assert int8.bytes_per_token == fp8.bytes_per_token == 2 * 2 * (64 + 4) and int8.quantized
    assert int8.scale_shape() == (16, 2)
    assert kv_storage_dtype("auto", "bfloat16") == "bfloat16"
    assert kv_storage_dtype("fp8", "float32") == kv_storage_dtype("fp8_e4m3", "float32") == "float8_e4m3fn"
    with pytest.raises(ValueError, match="kv_cache_dtype 'int4' unknown"):
        kv_storage_dtype("int4", "bfloat16")


def test_unknown_kv_cache_dtype_is_refused_at_start(llama_dir: str) -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp8_e5m2' unknown"):
        LLM(llama_dir, kv_cache_dtype="fp8_e5m2")


def wide_head_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A one-layer Llama with head size 128 (the KV shape of common 1B-8B models), bfloat16."""
    out = str(tmp_path_factory.mktemp("wide-head"))
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                                   max_position_embeddings=4096, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out)
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["head_dim"] == 128
    return out


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return wide_head_model(tmp_path_factory)


def test_the_pool_holds_about_twice_the_2k_sequences_with_int8(wide_dir: str) -> None:
    # the same --kv-cache-memory: the planned and allocated pool, in 2048-token sequences
    seqs, nbytes = {}, {}
    for kv in ("auto", "int8", "fp8_e4m3"):
        llm = LLM(wide_dir, dtype="bfloat16", skip_tokenizer_init=True, kv_cache_memory="8MiB", block_size=16,
                  kv_cache_dtype=kv)
        runner = llm.engine.core.executor.runner
        blocks = llm.engine.core.scheduler.kv.pool.num_blocks
        assert blocks == llm.engine.core.executor.kv_cache_config.num_blocks
        seqs[kv] = blocks // (2048 // 16)
        nbytes[kv] = runner.kv_caches.nbytes
        assert nbytes[kv] <= 8 << 20 and nbytes[kv] == blocks * llm.engine.core.executor.kv_cache_config.bytes_per_block
        layer = next(iter(attention_layers(runner.model).values()))
        assert layer.kv_cache.dtype == {"auto": torch.bfloat16, "int8": torch.int8,
                                        "fp8_e4m3": torch.float8_e4m3fn}[kv]
        if kv == "auto":
            assert layer.kv_scales is None
        else:
            assert layer.kv_scales is not None and layer.kv_scales.k.shape == (blocks, 16, 1)
    # bf16: 2 x 128 x 2 B per token and kv head; int8 and fp8: 2 x (128 + 4) B (the float32 scale)
    assert seqs["auto"] == (8 << 20) // (2048 * 2 * 128 * 2) == 8
    assert seqs["int8"] == seqs["fp8_e4m3"] == (8 << 20) // (2048 * 2 * 132) == 15
    assert seqs["int8"] >= 1.85 * seqs["auto"]


@pytest.fixture(scope="module")
def reference(model_dirs: dict[str, str]) -> dict[str, list[list[int]]]:
    """torch_ref's greedy output with an int8 cache, one plain run per model."""
    out = {}
    for name in ("llama-gqa4-untied", "mistral-window", "qwen2-mha"):
        llm = LLM(model_dirs[name], dtype="float32", kv_cache_memory="8MiB", attention_backend="torch_ref",
                  kv_cache_dtype="int8")
        out[name] = greedy_ids(llm, PROMPTS, MAX_TOKENS)
    return out


@pytest.mark.parametrize("backend", ["sdpa", "cpu"])
@pytest.mark.parametrize("name", ["llama-gqa4-untied", "mistral-window"])
def test_mixed_batch_and_chunked_prefill_match_the_reference(model_dirs: dict[str, str], name: str, backend: str,
                                                             reference: dict[str, list[list[int]]]) -> None:
    llm = LLM(model_dirs[name], dtype="float32", kv_cache_memory="8MiB", attention_backend=backend,
              kv_cache_dtype="int8", max_num_batched_tokens=8, max_num_seqs=4)
    assert greedy_ids(llm, PROMPTS, MAX_TOKENS) == reference[name]


@pytest.mark.parametrize("backend", ["torch_ref", "cpu"])
def test_preemption_matches_the_reference(model_dirs: dict[str, str], backend: str,
                                          reference: dict[str, list[list[int]]]) -> None:
    # 12 blocks of 8 tokens: max_model_len 96 fits, the batch does not
    llm = LLM(model_dirs["llama-gqa4-untied"], dtype="float32", num_kv_blocks=12, block_size=8, max_model_len=96,
              attention_backend=backend, kv_cache_dtype="int8")
    got = greedy_ids(llm, PROMPTS, MAX_TOKENS)
    assert llm.engine.core.scheduler.num_preemptions > 0
    assert got == reference["llama-gqa4-untied"]


@pytest.mark.parametrize("backend", ["torch_ref", "cpu"])
def test_prefix_hits_match_the_reference(model_dirs: dict[str, str], backend: str) -> None:
    shared = random_prompts(1, 40, 40, seed=7)[0]
    prompts = [shared + tail for tail in random_prompts(6, 1, 20, seed=8)]
    max_tokens = [10, 4, 16, 8, 12, 6]
    args = dict(dtype="float32", kv_cache_memory="8MiB", block_size=16, kv_cache_dtype="int8")
    plain = LLM(model_dirs["qwen2-mha"], attention_backend="torch_ref", enable_prefix_caching=False, **args)
    expected = greedy_ids(plain, prompts, max_tokens)
    llm = LLM(model_dirs["qwen2-mha"], attention_backend=backend, **args)
    first = greedy_ids(llm, prompts[:1], max_tokens[:1])
    kv = llm.engine.core.scheduler.kv
    hits_before = kv.prefix_hits
    rest = greedy_ids(llm, prompts[1:], max_tokens[1:])
    assert kv.prefix_hits - hits_before >= 5 * 32
    assert first + rest == expected


def test_fp8_cache_matches_the_reference(model_dirs: dict[str, str]) -> None:
    outs = {}
    for backend in ("torch_ref", "cpu"):
        llm = LLM(model_dirs["llama-gqa4-untied"], dtype="float32", kv_cache_memory="8MiB",
                  attention_backend=backend, kv_cache_dtype="fp8_e4m3", max_num_batched_tokens=16)
        outs[backend] = greedy_ids(llm, PROMPTS[:5], MAX_TOKENS[:5])
    assert outs["cpu"] == outs["torch_ref"]


def test_bf16_model_takes_the_fused_decode_and_runs(llama_dir: str) -> None:
    # the fused loop writes and reads the quantized cache (tests/kernels/cpu/fused_decode: equal to the layer loop)
    require_fused_decode()
    llm = LLM(llama_dir, dtype="bfloat16", kv_cache_memory="8MiB", kv_cache_dtype="int8")
    runner = llm.engine.core.executor.runner
    assert runner.fused_decode is not None and len(runner.fused_decode.kv_scales) == 2 * len(runner.model.layers)
    assert all(len(ids) == n for ids, n in zip(greedy_ids(llm, PROMPTS[:3], MAX_TOKENS[:3]), MAX_TOKENS[:3]))


def test_bf16_long_chunks_over_an_int8_cache_score_prompts_as_the_sdpa_path(
        model_dirs: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    # bf16 prompts of 70-150 tokens in chunks of up to 128 (head size 32, which the kernel takes): the chunks of 64
    # rows or more take the C++ prefill kernel over their dequantized context where it runs; the reference is the
    # same engine with them on SDPA's path. Every prompt position's log-probability of the next prompt token depends
    # on its chunk's attention, so both paths must score the prompts alike (bf16 greedy continuations of random
    # weights part at near ties, so tokens are not compared)
    from tokenmill import SamplingParams
    from tokenmill.attention.cpu import CpuBackend

    model = model_dirs["qwen3-qknorm"]
    prompts = random_prompts(4, 70, 150, seed=3)
    args = dict(dtype="bfloat16", kv_cache_memory="8MiB", attention_backend="cpu", kv_cache_dtype="int8",
                max_num_batched_tokens=128, skip_tokenizer_init=True)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)

    def scores() -> torch.Tensor:
        outs = LLM(model, **args).generate(prompts, params, use_tqdm=False)
        return torch.tensor([entry[tok].logprob for o, p in zip(outs, prompts, strict=True)
                             for entry, tok in zip(o.prompt_logprobs[1:], p[1:], strict=True)])

    taken: list[bool] = []
    real = CpuBackend._dequantized_prefill

    def spy(self: CpuBackend, q: torch.Tensor, ctx: int) -> bool:
        taken.append(real(self, q, ctx))
        return taken[-1]

    monkeypatch.setattr(CpuBackend, "_dequantized_prefill", spy)
    got = scores()
    if not any(taken):
        pytest.skip("the C++ prefill kernel does not take these chunks here")
    monkeypatch.setattr(CpuBackend, "_dequantized_prefill", lambda self, q, ctx: False)
    expected = scores()
    diff = (got - expected).abs()
    # bf16 sums in another order: 0.043 at most and 0.008 on average on this model and host (scores ~7.4)
    assert float(diff.max()) < 0.15 and float(diff.mean()) < 0.02, (float(diff.max()), float(diff.mean()))
