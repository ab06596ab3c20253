"""Medusa speculation through the engine: the shipped heads for the demo model change no greedy token in
a mixed batch (with chunked prefill) and take several tokens a step; at temperature > 0 the tokens
keep the target's distribution (the chi-square test of test_distribution.py) and fail it when every
draft is accepted."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import random_prompts
from tests.spec_decode.test_distribution import N, Target, accepts_every_draft, always_accepts, p_value, sample
from tokenmill import LLM, SamplingParams
from tokenmill.spec_decode.medusa import MedusaConfig, MedusaHeads
from tokenmill.worker import sampler, sampling_metadata

REPO = Path(__file__).resolve().parents[2]
DEMO, HEADS = REPO / "models" / "tokenmill-demo", REPO / "models" / "tokenmill-demo-medusa"
PROMPTS = ["KING.\nWhat news from France, my lord?\n\nMESSENGER.\n", "O, what a noble mind is here",
           "<|user|>\nGood morrow, sir. What news from the court?<|end|>\n<|assistant|>\n", "ROMEO.\n",
           "HAMLET.\nTo be, or not to be, that is the question:\n"]


def medusa(model: Path | str, k: int) -> dict[str, Any]:
    return {"method": "medusa", "model": str(model), "num_speculative_tokens": k}


def generate(llm: LLM, prompts: list[Any], params: list[SamplingParams]) -> tuple[list[list[int]], int]:
    """Each request's tokens, and the engine steps they took."""
    sched = llm.engine.core.scheduler
    steps = sched.num_steps
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert sched.kv.num_free_blocks == sched.kv.pool.num_blocks  # nothing left behind
    return [list(o.outputs[0].token_ids) for o in outs], sched.num_steps - steps


def test_the_shipped_heads_change_no_greedy_token() -> None:
    """A mixed batch, its prompts prefilled in chunks beside the other requests' decodes."""
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    params = [greedy, greedy.clone(max_tokens=11), greedy.clone(repetition_penalty=1.3, logprobs=2),
              greedy.clone(ignore_eos=False), greedy.clone(min_tokens=5, max_tokens=20)]
    common: dict[str, Any] = dict(dtype="float32", block_size=16, kv_cache_memory="16MiB",
                                  max_num_batched_tokens=24, max_num_seqs=4)
    plain, plain_steps = generate(LLM(str(DEMO), **common), PROMPTS, params)
    # adaptive off: the cost gate would turn proposing off where drafted steps were measured slower
    spec, steps = generate(LLM(str(DEMO), speculative_config={**medusa(HEADS, 4), "adaptive": False}, **common),
                           PROMPTS, params)
    assert spec == plain
    assert steps < 0.9 * plain_steps, (steps, plain_steps)  # drafts were taken


def fixed_heads(hidden: int, vocab: int, guesses: list[int], out: Path) -> Path:
    """Heads whose guesses are fixed: head i's bias pushes its output along axis i, the only axis the
    lm_head reads, for guesses[i] alone (every other token scores 0)."""
    heads = MedusaHeads(MedusaConfig(hidden, vocab, len(guesses), 1))
    with torch.no_grad():
        heads.lm_head.weight.zero_()
        for i, (head, token) in enumerate(zip(heads.heads, guesses, strict=True)):
            head[0].linear.bias[i] = 30.0
            heads.lm_head.weight[token, i] = 1.0
    heads.save(out, dtype=torch.float32)
    return out


@pytest.mark.parametrize("broken", [False, True], ids=["rule", "broken_rule"])
def test_medusa_keeps_the_target_distribution(broken: bool, llama_dir: str, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """As test_distribution.py does for the other methods: the second and third output tokens of 1200
    seeded requests at temperature 1, top-k 4, against the target's exact marginals; the heads guess
    the likeliest of each, so drafts are often accepted; accepting every draft fails the test."""
    torch.set_num_threads(1)
    prompt = random_prompts(1, 12, 12, seed=70)[0]
    second, third = Target(llama_dir).marginals(prompt)
    config = json.loads((Path(llama_dir) / "config.json").read_text())
    guesses = [max(second, key=lambda t: second[t]), max(third, key=lambda t: third[t])]
    heads = fixed_heads(config["hidden_size"], config["vocab_size"], guesses, tmp_path / "heads")
    llm = LLM(llama_dir, dtype="float32", num_threads=1, max_num_seqs=512, max_num_batched_tokens=8192,
              kv_cache_memory="64MiB", speculative_config={**medusa(heads, 2), "adaptive": False})
    if broken:
        monkeypatch.setattr(sampling_metadata, "accepted_run", always_accepts)
        monkeypatch.setattr(sampler, "verify_with_draft_probs", accepts_every_draft)
    runs = sample(llm, prompt, None)
    sched = llm.engine.core.scheduler
    assert sched.spec.num_draft_tokens >= N  # drafts for the second and third tokens
    p2 = p_value(Counter(r[1] for r in runs), second)
    p3 = p_value(Counter(r[2] for r in runs), third)
    if broken:
        assert min(p2, p3) < 1e-6, (p2, p3)
    else:
        assert sched.spec.num_accepted_tokens > N / 10  # the check sees accepted drafts, not only rejections
        assert min(p2, p3) > 1e-4, (p2, p3)


def test_heads_for_another_model_are_one_clear_error_at_start(llama_dir: str) -> None:
    with pytest.raises(ValueError, match="hidden_size 512, the target model's is 64"):
        LLM(llama_dir, dtype="float32", kv_cache_memory="8MiB", speculative_config=medusa(HEADS, 2))
    with pytest.raises(ValueError, match="num_speculative_tokens is 5; these medusa heads propose 1 to 4"):
        LLM(str(DEMO), dtype="float32", kv_cache_memory="8MiB", speculative_config=medusa(HEADS, 5))


def test_greedy_steps_keep_the_hidden_states_through_the_fused_calls() -> None:
    """With a proposer that reads hidden states, plain greedy steps and verification steps run the fused forward
    and then the fused lm_head and argmax over its hidden states (kept for the heads), not compute_logits and the
    sampler; the tokens are those of no speculation."""
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    llm = LLM(str(DEMO), speculative_config={**medusa(HEADS, 2), "adaptive": False}, kv_cache_memory="16MiB")
    fused = llm.engine.core.executor.runner.fused_decode
    if fused is None:
        pytest.skip("no fused decode step on this CPU")
    calls: Counter[str] = Counter()
    for name in ("greedy", "greedy_from_hidden"):
        method = getattr(fused, name)
        setattr(fused, name, lambda *a, _m=method, _n=name, **k: (calls.update([_n]), _m(*a, **k))[1])
    spec, _ = generate(llm, PROMPTS[:3], [greedy] * 3)
    plain, _ = generate(LLM(str(DEMO), kv_cache_memory="16MiB"), PROMPTS[:3], [greedy] * 3)
    assert spec == plain
    assert calls["greedy_from_hidden"] >= 8 and calls["greedy"] == 0, calls
