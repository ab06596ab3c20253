"""Only the sampled rows through the last layer (OutputRows) against every row through it: the same
tokens (in bf16, up to a near-tie of the reference's logits), and logprobs within rounding (the last
layer's attention for those rows runs as decodes),
with prefill chunks that end mid-prompt (no row kept), prefix-cache hits, preemption, sliding
windows and prompt logprobs (which keep every row)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import random_prompts
from tokenmill import LLM, SamplingParams


class CountingModel:
    """Records the rows kept in each forward call given OutputRows."""

    def __init__(self, model: Any) -> None:
        self.model, self.kept = model, []

    def __call__(self, *args: Any) -> Any:
        rows = args[3] if len(args) > 3 else None
        if rows is not None:
            self.kept.append(rows.index.numel())
        return self.model(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


def _run(model_dir: str, rows_only: bool, prompts: list[list[int]], params: Any, dtype: str,
         backend: str, **engine_args: Any) -> tuple[list[Any], CountingModel]:
    llm = LLM(model_dir, dtype=dtype, attention_backend=backend, device="cpu", **engine_args)
    runner = llm.engine.core.executor.runner
    runner.output_rows_only = rows_only
    counter = CountingModel(runner.model)
    runner.model = counter
    return llm.generate(prompts, params, use_tqdm=False), counter


@pytest.mark.parametrize("name", ["llama-gqa2-tied", "qwen3-qknorm", "mistral-window"])
@pytest.mark.parametrize("dtype,backend", [("bfloat16", "cpu"), ("float32", "torch_ref"), ("float32", "sdpa")])
def test_output_rows_match_every_row(model_dirs: dict[str, str], name: str, dtype: str, backend: str) -> None:
    shared = random_prompts(1, 40, 40, seed=3)[0]
    prompts = random_prompts(9, 3, 60, seed=2) + [shared + p for p in random_prompts(3, 2, 20, seed=4)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    # 16-token chunks: longer prompts end chunks mid-prompt, where no row is kept at all
    args: dict[str, Any] = dict(kv_cache_memory="4MiB", max_num_batched_tokens=16, max_num_seqs=6, block_size=8)
    fast, counted = _run(model_dirs[name], True, prompts, params, dtype, backend, **args)
    ref, unused = _run(model_dirs[name], False, prompts, params, dtype, backend, **args)
    assert counted.kept and 0 in counted.kept and not unused.kept
    tol = 0.1 if dtype == "bfloat16" else 1e-4  # bf16: one rounding of the attention output apart
    for a, b in zip(fast, ref, strict=True):
        out_a, out_b = a.outputs[0], b.outputs[0]
        for tok_a, tok_b, lp_a, lp_b in zip(out_a.token_ids, out_b.token_ids, out_a.logprobs, out_b.logprobs,
                                            strict=True):
            if tok_a != tok_b:
                # only where the reference nearly ties (bf16 logits tie outright at times): the
                # sequences may part there, and are not compared further
                assert dtype == "bfloat16" and tok_a in lp_b and lp_b[tok_b].logprob - lp_b[tok_a].logprob < tol
                break
            assert abs(lp_a[tok_a].logprob - lp_b[tok_b].logprob) < tol


def test_prompt_logprobs_keep_every_row(model_dirs: dict[str, str]) -> None:
    prompts = random_prompts(3, 10, 30, seed=5)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=1)
    fast, counted = _run(model_dirs["llama-gqa2-tied"], True, prompts, params, "float32", "cpu",
                         kv_cache_memory="4MiB")
    ref, _ = _run(model_dirs["llama-gqa2-tied"], False, prompts, params, "float32", "cpu", kv_cache_memory="4MiB")
    assert not counted.kept  # every prefill row is scored
    for a, b in zip(fast, ref, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.prompt_logprobs == b.prompt_logprobs
