"""Draft verification in the sampler: greedy takes drafts while they are the argmax; random takes the
point-mass rule, which keeps the target distribution (checked by chi-square on a tiny vocabulary,
and shown to fail when the rule is broken), and a seeded request draws one uniform per token taken,
the same tokens as without drafts."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence

import pytest
import torch

from tokenmill.sampling_params import SamplingParams
from tokenmill.spec_decode.rejection_sampler import accepted_run
from tokenmill.worker import sampling_metadata
from tokenmill.worker.sampler import Sampler
from tokenmill.worker.sampling_metadata import SamplingRow, metadata_for


def row(params: SamplingParams, seed: int | None = None) -> SamplingRow:
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    return SamplingRow(params, [5, 6, 7], 3, (0,), gen)


def test_accepted_run() -> None:
    assert accepted_run([4], []) == [4]
    assert accepted_run([4, 9, 9], [4, 5]) == [4, 9]
    assert accepted_run([3, 9, 9], [4, 5]) == [3]
    assert accepted_run([4, 5, 6], [4, 5]) == [4, 5, 6]


def test_greedy_takes_drafts_while_they_are_the_argmax() -> None:
    from tokenmill.kernels import load_cpu_kernels

    logits = torch.full((4, 10), -5.0)
    for r, best in enumerate([3, 1, 4, 1]):
        logits[r, best] = 5.0
    greedy = [row(SamplingParams(temperature=0.0))]
    for sampler, lg in ((Sampler(), logits), (Sampler(load_cpu_kernels()), logits.bfloat16())):
        assert sampler(lg, metadata_for(greedy, drafts={0: [3, 1, 4]})).token_ids == [[3, 1, 4, 1]]
        assert sampler(lg, metadata_for(greedy, drafts={0: [3, 1, 5]})).token_ids == [[3, 1, 4]]
        assert sampler(lg, metadata_for(greedy, drafts={0: [2, 1, 4]})).token_ids == [[3]]
    # with other requests around it, and logprobs for each token taken
    rows = [row(SamplingParams(temperature=0.0, logprobs=1)), row(SamplingParams(temperature=0.0))]
    lg = torch.cat([logits, logits[2:3]])
    out = Sampler()(lg, metadata_for(rows, drafts={0: [3, 1, 5]}))
    assert out.token_ids == [[3, 1, 4], [4]]
    assert out.logprobs[1] is None and out.logprobs[0] is not None
    assert [entry[0][0] for entry in out.logprobs[0]] == [3, 1, 4]


def test_a_seeded_request_takes_the_tokens_it_would_take_without_drafts() -> None:
    logits = torch.randn(3, 12, generator=torch.Generator().manual_seed(0))
    drafts = [int(logits[0].argmax()), int(logits[1].argmax())]  # accepted now and then
    params = SamplingParams(temperature=1.0, top_k=8)
    lengths = Counter()
    for seed in range(300):
        spec = row(params, seed)
        run = Sampler()(logits, metadata_for([spec], drafts={0: drafts})).token_ids[0]
        plain, taken = row(params, seed), []
        for j in range(3):  # one position at a time, as without drafts
            taken.append(Sampler()(logits[j:j + 1], metadata_for([plain])).token_ids[0][0])
            if j == 2 or taken[-1] != drafts[j]:
                break
        assert run == taken, seed
        assert spec.generator is not None and plain.generator is not None
        assert torch.equal(spec.generator.get_state(), plain.generator.get_state())  # as many draws
        lengths[len(run)] += 1
    assert set(lengths) == {1, 2, 3}


# ---- the distribution ------------------------------------------------------------------------
P = [[0.1, 0.3, 0.25, 0.2, 0.15], [0.4, 0.05, 0.05, 0.3, 0.2], [0.2, 0.2, 0.2, 0.2, 0.2]]  # per position
DRAFTS = [1, 3]


def chi_square(counts: Counter[int], probs: Sequence[float]) -> float:
    total = sum(counts.values())
    if not total:  # nothing to compare: as far from any distribution as can be
        return math.inf
    return sum((counts[t] - total * p) ** 2 / (total * p) for t, p in enumerate(probs) if p > 0)


def runs(n: int, seeded: bool) -> list[list[int]]:
    torch.manual_seed(0)
    logits = torch.tensor([[math.log(p) for p in probs] for probs in P]).repeat(n, 1)
    rows = [row(SamplingParams(temperature=1.0), seed=i if seeded else None) for i in range(n)]
    return Sampler()(logits, metadata_for(rows, drafts={i: DRAFTS for i in range(n)})).token_ids


def statistics(taken: list[list[int]]) -> tuple[float, float, float, float]:
    """Chi-square of: the first token against p0; the first token where the draft was rejected
    against p0 without the draft; the second token where the first draft was accepted against p1;
    and the acceptance count's distance from p0(draft) in standard deviations."""
    d = DRAFTS[0]
    first = Counter(run[0] for run in taken)
    rejected = Counter(run[0] for run in taken if run[0] != d)
    residual = [0.0 if t == d else p / (1 - P[0][d]) for t, p in enumerate(P[0])]
    second = Counter(run[1] for run in taken if run[0] == d and len(run) > 1)
    n, p = len(taken), P[0][d]
    z = abs(first[d] - n * p) / math.sqrt(n * p * (1 - p))
    return chi_square(first, P[0]), chi_square(rejected, residual), chi_square(second, P[1]), z


# 4 degrees of freedom at most: chi-square passes 25 with probability under 1e-4
@pytest.mark.parametrize(("seeded", "n"), [(False, 6000), (True, 2000)])
def test_the_point_mass_rule_keeps_the_target_distribution(seeded: bool, n: int) -> None:
    taken = runs(n, seeded)
    assert all(1 <= len(r) <= 3 for r in taken)
    first, rejected, second, z = statistics(taken)
    assert first < 25 and rejected < 25 and second < 25 and z < 4, (first, rejected, second, z)


def always_accepts(target: Sequence[int], drafts: Sequence[int]) -> list[int]:
    return [*drafts, target[len(drafts)]]


def takes_the_next_rows_token(target: Sequence[int], drafts: Sequence[int]) -> list[int]:
    """On a rejection it takes the token sampled at the next position (another distribution)."""
    for j, draft in enumerate(drafts):
        if target[j] != draft:
            return [*target[:j], target[j + 1]]
    return list(target)


@pytest.mark.parametrize("broken", [always_accepts, takes_the_next_rows_token])
def test_a_broken_rule_fails_the_same_check(broken: Callable[[Sequence[int], Sequence[int]], list[int]],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sampling_metadata, "accepted_run", broken)
    first, rejected, second, z = statistics(runs(6000, seeded=False))
    assert max(first, rejected, second) > 100 or z > 10
