"""The worker allocates what the executor planned from the model's layer specs, binds each attention
layer to its slice, and a second model (a speculative-decoding draft) gets a cache of its own."""

from __future__ import annotations

import torch

from tests.conftest import random_prompts
from tokenmill import LLM, SamplingParams
from tokenmill.arch import load_arch_config
from tokenmill.attention import get_backend
from tokenmill.attention.backend import AttentionMetadata
from tokenmill.kv_cache_spec import FullAttentionSpec, plan_kv_cache
from tokenmill.layers.attention import attention_layers
from tokenmill.models.loader import load_model
from tokenmill.worker.kv_cache import allocate_kv_caches, bind_kv_caches, kv_cache_specs

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def test_executor_plans_from_the_layer_specs(model_dirs: dict[str, str]) -> None:
    llm = LLM(model_dirs["mistral-window"], dtype="float32", kv_cache_memory="2MiB", block_size=8)
    executor = llm.engine.core.executor
    [specs] = executor.collective_rpc("get_kv_cache_specs")
    arch = llm.engine.config.model.arch
    assert len(specs) == arch.num_layers
    assert all(s.sliding_window == arch.sliding_window and s.block_size == 8 for s in specs.values())
    plan = executor.kv_cache_config
    assert plan.num_blocks == (2 << 20) // plan.bytes_per_block == llm.engine.core.scheduler.kv.pool.num_blocks
    runner = executor.runner
    assert all(layer.sliding_window == arch.sliding_window for layer in attention_layers(runner.model).values())
    for name, layer in attention_layers(runner.model).items():
        assert layer.kv_cache.shape == (2, plan.num_blocks, 8, arch.num_kv_heads, arch.head_dim)
        assert layer.kv_cache.data_ptr() == runner.kv_caches.by_layer[name].data_ptr()


def _prefill(model: torch.nn.Module, prompt: list[int], block_size: int) -> torch.Tensor:
    n = len(prompt)
    blocks = list(range(-(-n // block_size)))
    meta = AttentionMetadata(slot_mapping=torch.arange(n), query_start_loc=[0, n], seq_lens=[n],
                             block_tables=[blocks], num_decodes=0, block_size=block_size)
    with torch.inference_mode():
        hidden = model(torch.tensor(prompt), torch.arange(n), meta)
        return model.compute_logits(hidden[-1:])


def test_a_second_model_gets_its_own_cache(model_dirs: dict[str, str]) -> None:
    target_dir, draft_dir = model_dirs["llama-gqa2-tied"], model_dirs["llama-gqa4-untied"]
    llm = LLM(target_dir, dtype="float32", kv_cache_memory="1MiB", block_size=8)
    prompts = random_prompts(3, 5, 30, seed=11)
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]

    draft = load_model(draft_dir, load_arch_config(draft_dir), torch.float32, torch.device("cpu"))
    plan = plan_kv_cache(kv_cache_specs(draft, 8, "float32"), budget_bytes=256 << 10)
    assert isinstance(plan.groups[0].spec, FullAttentionSpec) and plan.groups[0].spec.num_kv_heads == 1
    caches = allocate_kv_caches(plan, torch.device("cpu"))
    bind_kv_caches(draft, caches, get_backend("torch_ref"))
    target_ptrs = {t.data_ptr() for t, _ in llm.engine.core.executor.runner.kv_caches.groups}
    assert not target_ptrs & {t.data_ptr() for t, _ in caches.groups}

    # the draft computes through its own cache (its logits match a second, fresh cache's) ...
    logits = _prefill(draft, prompts[0], 8)
    assert bool(caches.groups[0][0].abs().sum() > 0)
    fresh = allocate_kv_caches(plan, torch.device("cpu"))
    bind_kv_caches(draft, fresh, get_backend("torch_ref"))
    torch.testing.assert_close(_prefill(draft, prompts[0], 8), logits, rtol=0, atol=0)
    # ... and the target's generations are untouched by it
    after = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert after == before
