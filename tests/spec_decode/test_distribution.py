"""Each method keeps the target's distribution at temperature > 0: over a thousand seeded requests on
the tiny Llama, the second and third output tokens (the ones drafts are verified for) follow the
target's exact marginals (from transformers, top-k 4) by a chi-square test; the same test fails when
the acceptance rule is broken (every draft accepted)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from scipy import stats

from tests.conftest import random_prompts
from tokenmill import LLM, SamplingParams
from tokenmill.worker import sampler, sampling_metadata

N = 1200
TOP_K = 4


def filtered(logits: torch.Tensor) -> torch.Tensor:
    """The sampler's distribution: temperature 1, top-k 4, renormalised."""
    top = logits.topk(TOP_K)
    return torch.zeros_like(logits).scatter_(0, top.indices, top.values.softmax(dim=0))


class Target:
    """The tiny Llama's exact next-token distributions, through transformers."""

    def __init__(self, model_dir: str) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.cache: dict[tuple[int, ...], torch.Tensor] = {}

    @torch.no_grad()
    def next(self, tokens: Sequence[int]) -> torch.Tensor:
        key = tuple(tokens)
        if key not in self.cache:
            self.cache[key] = filtered(self.model(torch.tensor([list(tokens)])).logits[0, -1].double())
        return self.cache[key]

    def marginals(self, prompt: list[int]) -> tuple[dict[int, float], dict[int, float]]:
        """The distributions of the second and third output tokens."""
        second: Counter[int] = Counter()
        third: Counter[int] = Counter()
        p1 = self.next(prompt)
        for t1 in p1.nonzero()[:, 0].tolist():
            p2 = self.next(prompt + [t1])
            for t2 in p2.nonzero()[:, 0].tolist():
                w = float(p1[t1] * p2[t2])
                second[t2] += w
                p3 = self.next(prompt + [t1, t2])
                for t3 in p3.nonzero()[:, 0].tolist():
                    third[t3] += w * float(p3[t3])
        return dict(second), dict(third)


def reference_of_likely_pairs(target: Target, prompt: list[int]) -> list[int]:
    """A reference text (a Predicted Output) in which each possible first output token is followed by
    its likeliest next one: prompt lookup over it drafts that token, which is accepted often."""
    ref: list[int] = []
    for t1 in target.next(prompt).nonzero()[:, 0].tolist():
        ref += [t1, int(target.next(prompt + [t1]).argmax())]
    return ref


def p_value(observed: Counter[int], expected: dict[int, float]) -> float:
    """Chi-square goodness of fit; a token the target never gives makes the fit fail outright."""
    if any(t not in expected for t in observed):
        return 0.0
    total = sum(observed.values())
    keys = sorted(expected)
    chi = sum((observed[t] - total * expected[t]) ** 2 / (total * expected[t]) for t in keys)
    return float(stats.chi2.sf(chi, len(keys) - 1))


def sample(llm: LLM, prompt: list[int], reference: list[int] | None) -> list[list[int]]:
    params = [SamplingParams(temperature=1.0, top_k=TOP_K, seed=1000 + i, max_tokens=3, ignore_eos=True,
                             prediction_token_ids=reference) for i in range(N)]
    outs = llm.generate([{"prompt_token_ids": prompt}] * N, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def setup(llama_dir: str) -> tuple[list[int], list[int], dict[int, float], dict[int, float]]:
    torch.set_num_threads(1)
    target = Target(llama_dir)
    prompt = random_prompts(1, 12, 12, seed=70)[0]
    return prompt, reference_of_likely_pairs(target, prompt), *target.marginals(prompt)


def engine(llama_dir: str, draft_dir: str, method: str) -> LLM:
    # lookahead with 2-grams: its pool holds what followed each prompt token, as prompt lookup's n = 1
    cfg: dict[str, Any] = {"method": method, "num_speculative_tokens": 2, "adaptive": False, "lookahead_ngram": 2}
    if method == "draft_model":
        cfg["model"] = draft_dir
    return LLM(llama_dir, dtype="float32", num_threads=1, max_num_seqs=512, max_num_batched_tokens=8192,
               kv_cache_memory="64MiB", speculative_config=cfg)


def always_accepts(target: Sequence[int], drafts: Sequence[int]) -> list[int]:
    return [*drafts, target[len(drafts)]]


def accepts_every_draft(chosen: torch.Tensor, probs: torch.Tensor, q: torch.Tensor, first: int,
                        drafts: list[int], gen: torch.Generator | None) -> None:
    for j, d in enumerate(drafts):
        chosen[first + j] = d
    chosen[first + len(drafts)] = torch.multinomial(probs[first + len(drafts)], 1, generator=gen)[0]


@pytest.mark.parametrize("broken", [False, True], ids=["rule", "broken_rule"])
@pytest.mark.parametrize("method", ["ngram", "lookahead", "draft_model"])
def test_speculation_keeps_the_target_distribution(method: str, broken: bool, llama_dir: str, draft_dir: str,
                                                   setup: tuple[list[int], list[int], dict[int, float],
                                                                dict[int, float]],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    prompt, reference, second, third = setup
    llm = engine(llama_dir, draft_dir, method)
    if broken:
        monkeypatch.setattr(sampling_metadata, "accepted_run", always_accepts)
        monkeypatch.setattr(sampler, "verify_with_draft_probs", accepts_every_draft)
    # prompt lookup drafts from the reference (as it does from the prompt), so that its drafts are often right
    runs = sample(llm, prompt, reference if method == "ngram" else None)
    sched = llm.engine.core.scheduler
    assert sched.spec.num_draft_tokens >= N  # drafts for the second and third tokens
    p2 = p_value(Counter(r[1] for r in runs), second)
    p3 = p_value(Counter(r[2] for r in runs), third)
    if broken:
        assert min(p2, p3) < 1e-6, (p2, p3)
    else:
        if method != "lookahead":  # (the random model's Jacobi iterates are rarely its samples)
            assert sched.spec.num_accepted_tokens > N / 10  # the check sees accepted drafts, not only rejections
        assert min(p2, p3) > 1e-4, (p2, p3)
