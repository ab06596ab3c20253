"""Mixture-of-experts and latent-attention models (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek V2/V3):
greedy tokens identical to transformers with chunked prefill, prefix-cache hits and preemption on every
attention backend (single requests and mixed batches: tests/models/test_golden.py), the reference MoE
path, transformers 5's fused expert layout, MLA's absorbed decode, missing expert tensors named, and
which MoE models the fused C++ decode path takes (Mixtral) or declines."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from tests.conftest import random_prompts
from tests.fixtures import _hf_model, hf_greedy, require_fused_decode
from tests.models.test_golden import BACKENDS, MAX_TOKENS, PROMPTS, expected, run
from tokenmill import LLM, SamplingParams
from tokenmill.arch_moe import MLAConfig
from tokenmill.attention.backend import AttentionMetadata, gather_context
from tokenmill.layers.mla import MLAAttention
from tokenmill.layers.moe import SparseMoeBlock

MOE = ["mixtral-8x-top2", "qwen2moe-shared", "qwen3moe-norm"]
MLA = ["deepseek-v2-mla", "deepseek-v3-mla"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", MOE + MLA)
def test_chunked_prefill(model_dirs: dict[str, str], name: str, backend: str) -> None:
    model_dir = model_dirs[name]
    llm = LLM(model_dir, dtype="float32", kv_cache_memory="8MiB", attention_backend=backend,
              max_num_batched_tokens=8, max_num_seqs=4)
    assert run(llm, PROMPTS[:5], MAX_TOKENS[:5]) == expected(model_dir, PROMPTS[:5], MAX_TOKENS[:5])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", MOE + MLA)
def test_preemption_and_prefix_hits(model_dirs: dict[str, str], name: str, backend: str) -> None:
    model_dir = model_dirs[name]
    # 12 blocks of 8 tokens: max_model_len 96 fits, the batch does not
    llm = LLM(model_dir, dtype="float32", num_kv_blocks=12, block_size=8, max_model_len=96,
              attention_backend=backend)
    assert run(llm, PROMPTS, MAX_TOKENS) == expected(model_dir, PROMPTS, MAX_TOKENS)
    assert llm.engine.core.scheduler.num_preemptions > 0
    assert llm.engine.core.scheduler.kv.num_free_blocks == 12
    shared = random_prompts(1, 40, 40, seed=7)[0]
    prompts = [shared + tail for tail in random_prompts(3, 1, 20, seed=8)]
    kv = llm.engine.core.scheduler.kv
    first = run(llm, prompts[:1], [10])
    hits = kv.prefix_hits
    rest = run(llm, prompts[1:], [4, 16])
    assert kv.prefix_hits - hits >= 2 * 40 // 8 * 8
    assert first + rest == expected(model_dir, prompts, [10, 4, 16])


@pytest.mark.parametrize("name", ["qwen2moe-shared", "deepseek-v3-mla"])
def test_reference_moe_path(model_dirs: dict[str, str], name: str) -> None:
    model_dir = model_dirs[name]
    llm = LLM(model_dir, dtype="float32", kv_cache_memory="8MiB")
    blocks = [m for m in llm.engine.core.executor.runner.model.modules() if isinstance(m, SparseMoeBlock)]
    assert blocks
    for block in blocks:
        block.fused = False
    assert run(llm, PROMPTS[:4], MAX_TOKENS[:4]) == expected(model_dir, PROMPTS[:4], MAX_TOKENS[:4])


def test_fused_expert_layout_loads(model_dirs: dict[str, str], tmp_path: os.PathLike[str]) -> None:
    """transformers 5 keeps experts as [E, 2I, H] / [E, H, I] tensors in memory; a checkpoint written
    in that layout loads into the same model."""
    src = model_dirs["qwen3moe-norm"]
    state = {k: v.contiguous() for k, v in _hf_model(src).state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    dst = os.path.join(tmp_path, "fused")
    os.makedirs(dst)
    save_file(state, os.path.join(dst, "model.safetensors"))
    for f in os.listdir(src):
        if not f.endswith(".safetensors"):
            os.system(f"cp {os.path.join(src, f)} {dst}")  # config, tokenizer
    llm = LLM(dst, dtype="float32", kv_cache_memory="4MiB")
    assert run(llm, PROMPTS[:2], MAX_TOKENS[:2]) == expected(src, PROMPTS[:2], MAX_TOKENS[:2])


@pytest.mark.parametrize(("name", "tensor", "named"), [
    ("mixtral-8x-top2", "model.layers.1.block_sparse_moe.experts.5.w3.weight",
     r"layers\.1\.mlp\.experts\.5\.gate_up_proj\.weight\[1\]"),
    ("deepseek-v2-mla", "model.layers.1.self_attn.kv_b_proj.weight", r"layers\.1\.self_attn\.kv_b_proj\.weight"),
    ("deepseek-v3-mla", "model.layers.2.mlp.gate.e_score_correction_bias",
     r"layers\.2\.mlp\.gate\.e_score_correction_bias"),
])
def test_missing_tensor_is_named(model_dirs: dict[str, str], tmp_path: os.PathLike[str], name: str, tensor: str,
                                 named: str) -> None:
    from safetensors.torch import load_file

    src = model_dirs[name]
    tensors = load_file(os.path.join(src, "model.safetensors"))
    del tensors[tensor]
    dst = os.path.join(tmp_path, "broken")
    os.makedirs(dst)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match=named):
        LLM(dst, dtype="float32", kv_cache_memory="4MiB", skip_tokenizer_init=True)


def test_fused_decode_takes_mixtral_and_declines_the_other_routings(model_dirs: dict[str, str]) -> None:
    """Mixtral's routed experts run in the fused decode kernel (tests/kernels/cpu/fused_decode: bitwise
    against the layer loop); a shared expert (Qwen2-MoE), q/k norms (Qwen3-MoE) and MLA keep the layer loop."""
    require_fused_decode()
    dense = LLM(model_dirs["llama-gqa2-tied"], dtype="bfloat16", kv_cache_memory="4MiB", attention_backend="cpu")
    if dense.engine.core.executor.runner.fused_decode is None:
        pytest.fail("the fused decode path is off for a dense model: the C++ kernels are not built")
    mixtral = LLM(model_dirs["mixtral-8x-top2"], dtype="bfloat16", kv_cache_memory="4MiB", attention_backend="cpu")
    assert mixtral.engine.core.executor.runner.fused_decode is not None
    for name in ("qwen2moe-shared", "qwen3moe-norm", "deepseek-v2-mla", "deepseek-v3-mla"):
        llm = LLM(model_dirs[name], dtype="bfloat16", kv_cache_memory="4MiB", attention_backend="cpu")
        assert llm.engine.core.executor.runner.fused_decode is None
        outs = llm.generate(PROMPTS[:3], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 5 for o in outs)


def test_absorbed_decodes_equal_decompressed_attention() -> None:
    """A step's decodes in the absorbed form (W_UK folded into the query, W_UV after, contexts of
    different lengths padded together) equal each one's decompressed attention."""
    torch.manual_seed(0)
    mla = MLAConfig(q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12)
    layer = MLAAttention(4, mla, 0.2)
    layer.kv_cache = torch.randn(3, 8, 32 + 8, dtype=torch.float64)
    w = torch.randn(4, 16 + 12, 32, dtype=torch.float64)
    w_uk, w_uv = w[:, :16], w[:, 16:]
    q_nope, q_pe = torch.randn(2, 4, 16, dtype=torch.float64), torch.randn(2, 4, 8, dtype=torch.float64)
    tables, lens = [[0, 1, 2], [2, 0]], [20, 13]
    meta = AttentionMetadata(slot_mapping=torch.tensor([19, 20]), query_start_loc=[0, 1, 2], seq_lens=lens,
                             block_tables=tables, num_decodes=2, block_size=8)
    absorbed = layer._decodes(q_nope, q_pe, meta, w_uk, w_uv)
    for i in range(2):
        context = gather_context(layer.kv_cache, tables[i], lens[i])
        one = layer._prefill(q_nope[i:i + 1], q_pe[i:i + 1], context[:, :32], context[:, 32:], w_uk, w_uv, lens[i])
        torch.testing.assert_close(absorbed[i], one[0], rtol=1e-5, atol=1e-5)  # softmax runs in float32


def test_hf_reference_is_not_trivial(model_dirs: dict[str, str]) -> None:
    """The MoE fixtures route differently per token (so routing bugs change the output)."""
    out = hf_greedy(model_dirs["deepseek-v3-mla"], PROMPTS[1], 20)
    assert len(set(out)) > 5
