"""Gemma 2 and Gemma 3 (text) against transformers, float32, on tiny random checkpoints built from
their configs (tests/fixtures.py): greedy tokens through chunked prefill with preemption and through
prefix-cache hits on every attention backend (single requests and mixed batches: test_golden.py),
logprobs under the final soft-cap, both config dialects, the mixed-window KV plan, and the fused
decode path declining these layers."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from tests.conftest import random_prompts
from tests.fixtures import (
    check_chunked_prefill_and_preemption,
    greedy_ids,
    hf_expected,
    hf_greedy_cached,
    hf_logprobs,
)
from tokenmill import LLM, SamplingParams
from tokenmill.arch import parse_arch_config
from tokenmill.attention.cpu import CpuBackend
from tokenmill.kv_cache_spec import FullAttentionSpec, SlidingWindowSpec
from tokenmill.layers.linear import gemv_layout_ok
from tokenmill.worker.fused_decode import FusedDecode

BACKENDS = ["torch_ref", "sdpa", "cpu"]
GEMMAS = ["gemma2-softcap", "gemma3-local-global"]
PROMPTS = random_prompts(5, 3, 45, seed=21)  # the fixtures' window (16) is shorter than most
MAX_TOKENS = [14, 6, 10, 16, 9]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", GEMMAS)
def test_chunked_prefill_and_preemption(model_dirs: dict[str, str], name: str, backend: str) -> None:
    check_chunked_prefill_and_preemption(model_dirs[name], backend, PROMPTS, MAX_TOKENS)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", GEMMAS)
def test_prefix_cache_hits(model_dirs: dict[str, str], name: str, backend: str) -> None:
    model_dir = model_dirs[name]
    shared = random_prompts(1, 40, 40, seed=22)[0]
    prompts = [shared + tail for tail in random_prompts(4, 1, 12, seed=23)]
    max_tokens = [10, 16, 5, 12]
    llm = LLM(model_dir, dtype="float32", kv_cache_memory="4MiB", attention_backend=backend, block_size=16)
    first = greedy_ids(llm, prompts[:1], max_tokens[:1])
    kv = llm.engine.core.scheduler.kv
    hits_before = kv.prefix_hits
    rest = greedy_ids(llm, prompts[1:], max_tokens[1:])
    assert kv.prefix_hits - hits_before >= 3 * 32  # the 2 full shared blocks, beyond the window
    assert first + rest == hf_expected(model_dir, prompts, max_tokens)


def test_logprobs_under_the_final_soft_cap(model_dirs: dict[str, str]) -> None:
    # the cap is monotonic, so greedy tokens cannot show it; log-probabilities do (the fixture's cap
    # of 3 flattens them far from the uncapped ones)
    model_dir = model_dirs["gemma2-softcap"]
    prompt = random_prompts(1, 20, 20, seed=24)[0]
    llm = LLM(model_dir, dtype="float32", kv_cache_memory="2MiB", attention_backend="sdpa")
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)
    completion = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert completion.logprobs is not None
    ref = hf_logprobs(model_dir, prompt + completion.token_ids)
    for j, (tok, entry) in enumerate(zip(completion.token_ids, completion.logprobs, strict=True)):
        assert entry[tok].logprob == pytest.approx(float(ref[len(prompt) + j - 1, tok]), abs=1e-4)


def _config(model_dir: str) -> dict:
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f)


def test_transformers4_dialect_parses_alike(model_dirs: dict[str, str]) -> None:
    """transformers 4 checkpoints write no layer_types (a pattern, or Gemma 2's alternation, stands
    for them) and Gemma 3's ropes as rope_theta, rope_scaling and rope_local_base_freq."""
    v5 = _config(model_dirs["gemma3-local-global"])
    params = v5["rope_parameters"]
    v4 = {k: v for k, v in v5.items() if k not in ("layer_types", "rope_parameters")}
    v4.update(sliding_window_pattern=6, rope_theta=params["full_attention"]["rope_theta"],
              rope_local_base_freq=params["sliding_attention"]["rope_theta"],
              rope_scaling={"rope_type": "linear", "factor": 8.0})
    a, b = parse_arch_config(v5), parse_arch_config(v4)
    assert a == b
    assert a.layer_types == ("sliding_attention",) * 5 + ("full_attention",)
    assert a.local_rope is not None and (a.local_rope.theta, a.local_rope.rope_type) == (10_000.0, "default")
    assert (a.rope.theta, a.rope.rope_type, a.rope.factor) == (1_000_000.0, "linear", 8.0)
    assert [a.layer_window(i) for i in range(6)] == [16] * 5 + [None]

    g2 = _config(model_dirs["gemma2-softcap"])
    old = parse_arch_config({k: v for k, v in g2.items() if k != "layer_types"})
    assert old == parse_arch_config(g2)
    assert [old.layer_window(i) for i in range(4)] == [16, None, 16, None]
    assert (old.attn_logit_softcapping, old.final_logit_softcapping, old.query_pre_attn_scalar) == (5.0, 3.0, 24.0)
    # a Gemma 2 config.json that leaves them out gets the family's values, as transformers does
    bare = parse_arch_config({k: v for k, v in g2.items() if "softcapping" not in k})
    assert (bare.attn_logit_softcapping, bare.final_logit_softcapping) == (50.0, 30.0)
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        parse_arch_config({**v5, "use_bidirectional_attention": True})
    with pytest.raises(ValueError, match="layer_types"):
        parse_arch_config({**v5, "layer_types": ["sliding_attention", "chunked_attention"] * 3})


def test_local_and_global_layers_plan_one_pool(model_dirs: dict[str, str]) -> None:
    llm = LLM(model_dirs["gemma3-local-global"], dtype="float32", kv_cache_memory="1MiB", block_size=8)
    plan = llm.engine.core.executor.kv_cache_config
    specs = {type(g.spec): len(g.layer_names) for g in plan.groups}
    assert specs == {SlidingWindowSpec: 5, FullAttentionSpec: 1}
    sliding = next(g.spec for g in plan.groups if isinstance(g.spec, SlidingWindowSpec))
    assert sliding.sliding_window == 16
    per_block = 6 * 2 * 8 * 1 * 32 * 4  # every layer keeps every block, the local ones read their window
    assert plan.bytes_per_block == per_block and plan.num_blocks == (1 << 20) // per_block


@pytest.mark.parametrize("name", GEMMAS)
def test_fused_decode_declines_gemma(model_dirs: dict[str, str], llama_dir: str, name: str) -> None:
    """The fused C++ decode loop runs Llama-shaped layers only: for Gemma's (sandwich norms, (1 + weight)
    norms, GeGLU, soft-caps) it declines and the layer path runs, where Llama's is taken."""
    backend = CpuBackend()
    if backend.ops is None or not backend.ops.has_packed_gemv() or not gemv_layout_ok(backend.ops):
        pytest.skip("needs the C++ kernels with the AVX512-BF16 GEMV, which the fused path runs on")
    runners = {}
    for key, model_dir in (("gemma", model_dirs[name]), ("llama", llama_dir)):
        llm = LLM(model_dir, dtype="bfloat16", kv_cache_memory="1MiB", attention_backend="cpu")
        runners[key] = llm.engine.core.executor.runner
    gemma, llama = runners["gemma"], runners["llama"]
    assert FusedDecode.create(gemma.model, backend.ops, backend) is None and gemma.fused_decode is None
    assert llama.fused_decode is not None
    # and the layer path it falls back to generates (bf16: no token-for-token reference here)
    llm = LLM(model_dirs[name], dtype="bfloat16", kv_cache_memory="1MiB", attention_backend="cpu")
    out = llm.generate(random_prompts(2, 5, 30, seed=25), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 8 for o in out)



# Gemma's turn format: the BOS, then each turn as <start_of_turn>{user|model}\n...<end_of_turn>\n (the
# assistant's role is "model"), and an open model turn for the reply
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def test_chat_with_gemma_turns(model_dirs: dict[str, str]) -> None:
    model_dir = model_dirs["gemma3-local-global"]
    llm = LLM(model_dir, dtype="float32", kv_cache_memory="1MiB")
    messages = [{"role": "user", "content": "def add(a, b):"}, {"role": "assistant", "content": "return a + b"},
                {"role": "user", "content": "and subtract?"}]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    out = llm.chat(messages, params, use_tqdm=False, chat_template=GEMMA_TEMPLATE)[0]
    tok = llm.get_tokenizer()
    text = tok.decode(out.prompt_token_ids)
    assert text.startswith("<|bos|><start_of_turn>user\ndef add") and text.endswith("<start_of_turn>model\n")
    assert out.outputs[0].token_ids == hf_greedy_cached(model_dir, tuple(out.prompt_token_ids), 8)


def test_checkpoint_missing_a_sandwich_norm_names_it(model_dirs: dict[str, str], tmp_path: os.PathLike[str]) -> None:
    from safetensors.torch import load_file, save_file

    dst = os.path.join(tmp_path, "gemma2-missing")
    shutil.copytree(model_dirs["gemma2-softcap"], dst)
    path = os.path.join(dst, "model.safetensors")
    tensors = load_file(path)
    del tensors["model.layers.2.pre_feedforward_layernorm.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing weights: \['layers\.2\.pre_feedforward_layernorm\.weight'\]"):
        LLM(dst, dtype="float32", kv_cache_memory="1MiB")
