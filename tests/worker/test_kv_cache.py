"""The worker allocates what the executor planned from the model's layer specs, binds each attention
layer to its slice, a second model (a speculative-decoding draft) gets a cache of its own, and the
copy-on-write block copies reach every layer's cache and scales."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import random_prompts
from tokenmill import LLM, SamplingParams
from tokenmill.arch import load_arch_config
from tokenmill.attention import get_backend
from tokenmill.attention.backend import AttentionMetadata
from tokenmill.kv_cache_spec import (
    FullAttentionSpec,
    KVCacheSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    plan_kv_cache,
)
from tokenmill.layers.attention import attention_layers
from tokenmill.models.loader import load_model
from tokenmill.worker.kv_cache import allocate_kv_caches, bind_kv_caches, copy_blocks, kv_cache_specs

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


COPY_SPECS: dict[str, dict[str, KVCacheSpec]] = {
    "float": {"l0": FullAttentionSpec(4, "float32", 2, 8), "l1": FullAttentionSpec(4, "float32", 2, 8),
              "l2": SlidingWindowSpec(4, "float32", 2, 8, 16), "l3": FullAttentionSpec(4, "bfloat16", 1, 16)},
    "int8": {"l0": FullAttentionSpec(4, "int8", 2, 8), "l1": FullAttentionSpec(4, "int8", 2, 8)},
    "fp8": {"l0": FullAttentionSpec(4, "float8_e4m3fn", 1, 16), "l1": FullAttentionSpec(4, "float32", 1, 16)},
    "mla": {"l0": MLAAttentionSpec(4, "bfloat16", 16, 8), "l1": MLAAttentionSpec(4, "bfloat16", 16, 8)},
}


@pytest.mark.parametrize("kind", list(COPY_SPECS))
def test_copy_blocks_matches_a_per_layer_reference(kind: str) -> None:
    """copy_blocks on the groups' whole tensors gives what copying each layer's K/V (or latent) rows and
    each quantized layer's scales block by block, in order, gives; no other block changes."""
    plan = plan_kv_cache(COPY_SPECS[kind], budget_bytes=0, num_blocks=7)
    caches = allocate_kv_caches(plan, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    for tensor, _ in caches.groups:
        values = torch.randn(tensor.shape, generator=gen) * 50
        tensor.copy_(values.round().clamp(-127, 127) if tensor.dtype == torch.int8 else values)
    layers = {name: t.clone() for name, t in caches.by_layer.items()}
    scales = {name: t.clone() for name, t in caches.scales_by_layer.items()}
    assert (len(scales) == 2) == (kind == "int8") and (len(scales) == 1) == (kind == "fp8")
    pairs = [(1, 5), (5, 2), (3, 0), (6, 4)]  # (5, 2) copies what (1, 5) put there
    for src, dst in pairs:
        for name, t in [*layers.items(), *scales.items()]:
            paired = not isinstance(COPY_SPECS[kind][name], MLAAttentionSpec)  # [2, blocks, ...] for K and V
            if paired:
                t[:, dst] = t[:, src]
            else:
                t[dst] = t[src]
    copy_blocks(caches, pairs)
    for got, want in [*((caches.by_layer[n], t) for n, t in layers.items()),
                      *((caches.scales_by_layer[n], t) for n, t in scales.items())]:
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    copy_blocks(caches, [])
