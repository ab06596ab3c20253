"""The sampler: seeded reproducibility, truncation filters, penalties and logit bias with
OpenAI/vLLM semantics, min_tokens, and logprobs against Hugging Face."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.conftest import random_prompts
from tests.fixtures import EOS, VOCAB, hf_logprobs
from tokenmill import LLM, SamplingParams
from tokenmill.outputs import PositionLogprobs
from tokenmill.worker import sampler as sampler_module
from tokenmill.worker.sampler import (
    FILTER_CANDIDATES,
    Sampler,
    apply_logit_processors,
    filter_logits,
    filter_logits_sorted,
)
from tokenmill.worker.sampling_metadata import SamplingMetadata, SamplingRow, is_plain_greedy, metadata_for

PROBS = [0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.015, 0.005]  # sorted, so token i has rank i + 1
LOGITS = [math.log(p) for p in PROBS]


@pytest.fixture(scope="module")
def llm(llama_dir: str) -> Iterator[LLM]:
    yield LLM(llama_dir, dtype="float32", kv_cache_memory="16MiB", seed=0)


def row(params: SamplingParams, prompt: list[int] | None = None, output: list[int] | None = None,
        generator: torch.Generator | None = None) -> SamplingRow:
    prompt = prompt or []
    return SamplingRow(params, prompt + (output or []), len(prompt), (EOS,), generator)


def tokens(sampler: Sampler, logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
    """Each row's token (one request a row, no drafts)."""
    return [t for (t,) in sampler(logits, metadata_for(rows)).token_ids]


# ---- seeded reproducibility ------------------------------------------------------------------
def test_seeded_request_is_the_same_alone_and_in_any_batch(llm: LLM) -> None:
    prompts = random_prompts(15, 4, 40, seed=11)
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=24, ignore_eos=True)
    other = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, ignore_eos=True)

    def tokens_of(batch: list[list[int]], where: int) -> list[int]:
        params = [other] * len(batch)
        params[where] = seeded
        return llm.generate(batch, params, use_tqdm=False)[where].outputs[0].token_ids

    alone = tokens_of([prompts[0]], 0)
    assert len(alone) == 24
    assert tokens_of([prompts[0], *prompts[1:8]], 0) == alone
    assert tokens_of([*prompts[8:13], prompts[0], *prompts[13:15]], 5) == alone
    greedy = llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids
    reseeded = llm.generate([prompts[0]], seeded.clone(seed=99), use_tqdm=False)[0].outputs[0].token_ids
    assert alone != greedy and alone != reseeded  # the seed, not argmax, decided these tokens


def test_seeded_rows_draw_from_their_own_generator() -> None:
    logits = torch.tensor([LOGITS] * 4)
    params = SamplingParams(temperature=1.0, seed=7)

    def draw(others: int, position: int) -> list[int]:
        gen = torch.Generator().manual_seed(7)
        out = []
        for _ in range(50):
            rows = [row(SamplingParams(temperature=1.0)) for _ in range(others)]
            rows.insert(position, row(params, generator=gen))
            out.append(tokens(Sampler(), logits[:len(rows)], rows)[position])
        return out

    assert draw(0, 0) == draw(3, 0) == draw(3, 2)


# ---- truncation ------------------------------------------------------------------------------
def allowed(top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> set[int]:
    """One filter's surviving tokens over PROBS (vLLM semantics: top-p over the top-k renormalized)."""
    probs = PROBS[:top_k] if top_k else PROBS
    total = sum(probs)
    keep, before = set(), 0.0
    for i, p in enumerate(probs):
        if before < top_p and p >= min_p * probs[0]:
            keep.add(i)
        before += p / total
    return keep


def sample_many(params: SamplingParams, n: int = 4000) -> list[int]:
    torch.manual_seed(0)
    logits = torch.tensor([LOGITS] * n)
    return tokens(Sampler(), logits, [row(params)] * n)


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"top_k": 3}, {0, 1, 2}),
        ({"top_k": 1}, {0}),
        ({"top_p": 0.5}, {0, 1}),
        ({"top_p": 0.85}, {0, 1, 2, 3}),
        ({"top_k": 3, "top_p": 0.7}, {0, 1}),  # top-p over the renormalized top 3
        ({"min_p": 0.3}, {0, 1, 2}),
        ({"min_p": 0.2}, {0, 1, 2, 3}),
    ],
)
def test_truncation_never_emits_an_excluded_token(kwargs: dict[str, Any], expected: set[int]) -> None:
    assert allowed(**kwargs) == expected  # the reference agrees with the table
    drawn = set(sample_many(SamplingParams(temperature=1.0, **kwargs)))
    assert drawn == expected  # nothing outside the set, and everything inside it is reachable


def test_combined_filters_exclude_whatever_any_one_excludes() -> None:
    drawn = set(sample_many(SamplingParams(temperature=1.0, top_k=5, top_p=0.75, min_p=0.2)))
    assert drawn and drawn <= allowed(top_k=5) & allowed(top_p=0.75) & allowed(min_p=0.2)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_unfiltered_sampling_follows_the_tempered_distribution(temperature: float) -> None:
    tokens = sample_many(SamplingParams(temperature=temperature), n=6000)
    weights = [p ** (1 / temperature) for p in PROBS]
    for tok, w in enumerate(weights):
        assert abs(tokens.count(tok) / len(tokens) - w / sum(weights)) < 0.03, tok


def test_greedy_ignores_filters_and_noise() -> None:
    logits = torch.tensor([LOGITS[::-1], LOGITS])
    params = SamplingParams(temperature=0.0, top_k=3, top_p=0.1, min_p=0.9)
    assert tokens(Sampler(), logits, [row(params), row(params)]) == [7, 0]


def big_vocab_logits(rows: int, vocab: int, sharpness: float, seed: int) -> torch.Tensor:
    """Logits over a vocabulary past FILTER_CANDIDATES: sharpness 0 is flat (the nucleus spans most of
    it), large is peaked (a trained model's: a few tokens hold the mass)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=gen) * (1 + sharpness) + torch.randn(rows, 1, generator=gen)


# (top_k, top_p, min_p) per row: each filter alone, combined, and rows asking for nothing beside them
FILTER_ROWS = [(0, 0.9, 0.0), (0, 0.5, 0.0), (40, 1.0, 0.0), (300, 0.95, 0.0), (0, 1.0, 0.1), (0, 1.0, 0.0),
               (50, 0.8, 0.05), (0, 0.99, 0.01), (1, 1.0, 0.0), (100000, 0.7, 0.0)]


@pytest.mark.parametrize(("sharpness", "sorts"), [(0.0, True), (2.0, None), (6.0, False)])
def test_filter_from_the_top_candidates_matches_the_full_sort(sharpness: float, sorts: bool | None,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    logits = big_vocab_logits(len(FILTER_ROWS), 5000, sharpness, seed=int(sharpness))
    top_k, top_p, min_p = (torch.tensor(c) for c in zip(*FILTER_ROWS, strict=True))
    expected = filter_logits_sorted(logits, top_k, top_p, min_p)
    fell_back: list[int] = []  # how many rows went to the full sort
    monkeypatch.setattr(sampler_module, "filter_logits_sorted",
                        lambda *a: fell_back.append(a[0].shape[0]) or filter_logits_sorted(*a))
    got = filter_logits(logits, top_k, top_p, min_p)
    assert torch.equal(got, expected)  # the same survivors, with their logits; -inf elsewhere
    # a flat distribution needs the full sort, for the rows without a top_k only; a peaked one is settled
    # from the top 300 (the largest top_k here) alone; in between it depends on the draw
    if sorts is not None:
        assert bool(fell_back) == sorts
    if fell_back:
        assert fell_back[0] <= sum(1 for k, p, m in FILTER_ROWS if k in (0, 100000) and (p < 1 or m > 0))


def test_filter_takes_the_top_candidates_alone_where_they_suffice(monkeypatch: pytest.MonkeyPatch) -> None:
    logits = big_vocab_logits(3, 5000, 6.0, seed=3)
    monkeypatch.setattr(sampler_module, "filter_logits_sorted", None)  # would fail if called
    got = filter_logits(logits, torch.tensor([0, 20, 0]), torch.tensor([0.9, 1.0, 1.0]), torch.tensor([0.0, 0.0, 0.0]))
    assert torch.equal(got[2], logits[2])  # a row asking for nothing keeps everything
    assert int(torch.isfinite(got[1]).sum()) == 20
    assert 0 < int(torch.isfinite(got[0]).sum()) <= FILTER_CANDIDATES[0]


def test_filter_widens_the_candidates_before_it_sorts(monkeypatch: pytest.MonkeyPatch) -> None:
    # a nucleus of ~900 tokens: past the first candidates, within the second
    logits = torch.full((2, 5000), -20.0)
    logits[:, :1000] = torch.randn(2, 1000, generator=torch.Generator().manual_seed(5)) * 0.1
    top_k, top_p, min_p = torch.tensor([0, 0]), torch.tensor([0.9, 0.95]), torch.tensor([0.0, 0.0])
    expected = filter_logits_sorted(logits, top_k, top_p, min_p)
    monkeypatch.setattr(sampler_module, "filter_logits_sorted", None)  # would fail if called
    got = filter_logits(logits, top_k, top_p, min_p)
    assert torch.equal(got, expected)
    assert FILTER_CANDIDATES[0] < int(torch.isfinite(got[0]).sum()) < FILTER_CANDIDATES[1]


def test_sampling_over_a_large_vocab_keeps_to_the_filtered_set_and_its_distribution() -> None:
    torch.manual_seed(0)
    vocab, n = 3000, 3000
    logits = torch.full((vocab,), -30.0)
    logits[[5, 17, 2999]] = torch.tensor([math.log(0.5), math.log(0.3), math.log(0.2)])  # ~all the mass
    rows = [row(SamplingParams(temperature=1.0, top_p=0.75))] * n
    drawn = tokens(Sampler(), logits.expand(n, vocab).clone(), rows)
    assert set(drawn) == {5, 17}  # top-p 0.75 keeps 0.5 and 0.3: nothing else, ever
    assert abs(drawn.count(5) / n - 0.5 / 0.8) < 0.03


# ---- penalties and logit bias ----------------------------------------------------------------
BASE = [2.0, -1.5, 0.5, -0.25, 3.0, -2.0, 1.0, 0.0, 4.0, -3.0]
PROMPT = [1, 2, 2, 9]
OUTPUT = [2, 3, 3, 3, 5, 8]


def processed(params: SamplingParams, output: list[int] = OUTPUT) -> list[float]:
    logits = torch.tensor([BASE])
    apply_logit_processors(logits, [row(params, PROMPT, output)])
    return logits[0].tolist()


def test_repetition_penalty_divides_positive_and_multiplies_negative_over_prompt_and_output() -> None:
    seen = set(PROMPT) | set(OUTPUT)
    expected = [(x / 1.5 if x > 0 else x * 1.5) if t in seen else x for t, x in enumerate(BASE)]
    assert processed(SamplingParams(repetition_penalty=1.5)) == pytest.approx(expected, abs=1e-6)


def test_frequency_penalty_scales_with_the_output_count_only() -> None:
    expected = [x - 0.5 * OUTPUT.count(t) for t, x in enumerate(BASE)]
    assert processed(SamplingParams(frequency_penalty=0.5)) == pytest.approx(expected, abs=1e-6)


def test_presence_penalty_is_flat_for_output_tokens_only() -> None:
    expected = [x - 0.75 * (t in OUTPUT) for t, x in enumerate(BASE)]
    assert processed(SamplingParams(presence_penalty=0.75)) == pytest.approx(expected, abs=1e-6)


def test_negative_penalties_encourage() -> None:
    expected = [x + 1.0 * OUTPUT.count(t) + 0.5 * (t in OUTPUT) for t, x in enumerate(BASE)]
    got = processed(SamplingParams(frequency_penalty=-1.0, presence_penalty=-0.5))
    assert got == pytest.approx(expected, abs=1e-6)


def test_logit_bias_adds_to_the_named_tokens() -> None:
    expected = list(BASE)
    expected[4] += 2.5
    expected[7] -= 3.0
    assert processed(SamplingParams(logit_bias={4: 2.5, 7: -3.0})) == pytest.approx(expected, abs=1e-6)


def test_all_processors_together_bias_first_then_penalties() -> None:
    params = SamplingParams(logit_bias={1: 4.0, 3: 1.0}, repetition_penalty=2.0, frequency_penalty=0.25,
                            presence_penalty=0.5)
    seen = set(PROMPT) | set(OUTPUT)
    expected = []
    for t, x in enumerate(BASE):
        x += params.logit_bias.get(t, 0.0)
        if t in seen:
            x = x / 2.0 if x > 0 else x * 2.0
        expected.append(x - 0.25 * OUTPUT.count(t) - 0.5 * (t in OUTPUT))
    assert processed(params) == pytest.approx(expected, abs=1e-6)


def test_no_penalty_leaves_logits_untouched() -> None:
    assert processed(SamplingParams()) == BASE


def test_penalties_change_the_greedy_choice() -> None:
    logits = torch.tensor([BASE])
    params = SamplingParams(temperature=0.0, presence_penalty=2.0, frequency_penalty=2.0)
    assert tokens(Sampler(), logits.clone(), [row(SamplingParams(temperature=0.0), PROMPT, OUTPUT)]) == [8]
    assert tokens(Sampler(), logits.clone(), [row(params, PROMPT, OUTPUT)]) == [4]
    assert tokens(Sampler(), logits.clone(), [row(params, PROMPT, [4, 4])]) == [8]


# ---- min_tokens ------------------------------------------------------------------------------
@pytest.mark.parametrize("ignore_eos", [False, True])
def test_min_tokens_masks_eos_and_stop_ids_until_reached(ignore_eos: bool) -> None:
    params = SamplingParams(min_tokens=3, stop_token_ids=[4, 6], ignore_eos=ignore_eos)
    for n_out, masked in ((0, True), (2, True), (3, False), (5, False)):
        got = processed(params, output=[7] * n_out)
        banned = ({4, 6} | (set() if ignore_eos else {EOS})) if masked else set()
        for t, x in enumerate(got):
            assert (x == float("-inf")) == (t in banned), (n_out, t)


def test_min_tokens_suppresses_eos_in_generation(llm: LLM) -> None:
    prompt = random_prompts(1, 8, 8, seed=3)[0]
    forced = SamplingParams(temperature=0.0, max_tokens=12, logit_bias={EOS: 100.0})
    assert llm.generate([prompt], forced, use_tqdm=False)[0].outputs[0].token_ids == [EOS]
    out = llm.generate([prompt], forced.clone(min_tokens=5), use_tqdm=False)[0].outputs[0]
    assert EOS not in out.token_ids[:5] and out.token_ids[5:] == [EOS]
    assert out.finish_reason == "stop"


def test_min_tokens_suppresses_stop_token_ids_in_generation(llm: LLM) -> None:
    prompt = random_prompts(1, 8, 8, seed=4)[0]
    params = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=3, stop_token_ids=[77],
                            logit_bias={77: 100.0})
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert 77 not in out.token_ids[:3] and out.token_ids[3:] == [77]
    assert (out.finish_reason, out.stop_reason) == ("stop", 77)


# ---- logprobs --------------------------------------------------------------------------------
def test_greedy_logprobs_match_hf_log_softmax(llm: LLM, llama_dir: str) -> None:
    prompt = random_prompts(1, 12, 12, seed=5)[0]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5, prompt_logprobs=5)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    completion = out.outputs[0]
    tokens = completion.token_ids
    assert completion.logprobs is not None and len(completion.logprobs) == len(tokens) == 8
    ref = hf_logprobs(llama_dir, prompt + tokens)
    assert ref.shape == (len(prompt) + len(tokens), VOCAB)
    L = len(prompt)
    for j, (tok, entry) in enumerate(zip(tokens, completion.logprobs)):
        row_ = ref[L + j - 1]
        assert tok == int(row_.argmax())
        assert entry[tok].rank == 1
        assert_top_n_match(entry, row_, 5)
    total = sum(float(ref[L + j - 1, t]) for j, t in enumerate(tokens))
    assert completion.cumulative_logprob == pytest.approx(total, abs=1e-3)

    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == L
    assert out.prompt_logprobs[0] is None
    for p in range(1, L):
        entry = out.prompt_logprobs[p]
        assert entry is not None
        row_ = ref[p - 1]
        actual = prompt[p]
        assert entry[actual].logprob == pytest.approx(float(row_[actual]), abs=1e-4)
        assert entry[actual].rank == int((row_ > row_[actual]).sum()) + 1
        assert_top_n_match(entry, row_, 5)


def assert_top_n_match(entry: PositionLogprobs, ref_row: torch.Tensor, n: int) -> None:
    top_lp, top_ids = ref_row.topk(n)
    for rank, (tid, lp) in enumerate(zip(top_ids.tolist(), top_lp.tolist()), start=1):
        assert tid in entry, (tid, sorted(entry))
        assert entry[tid].logprob == pytest.approx(lp, abs=1e-4)
        assert entry[tid].rank == rank
    assert len(entry) <= n + 1


def test_logprobs_are_raw_not_penalised(llm: LLM, llama_dir: str) -> None:
    """Logprobs are of the model's distribution, before bias and penalties pick the token."""
    prompt = random_prompts(1, 10, 10, seed=6)[0]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0,
                            logit_bias={123: 50.0}, repetition_penalty=1.3)
    completion = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert completion.token_ids == [123] * 4
    ref = hf_logprobs(llama_dir, prompt + completion.token_ids)
    assert completion.logprobs is not None
    for j, entry in enumerate(completion.logprobs):
        assert list(entry) == [123]
        assert entry[123].logprob == pytest.approx(float(ref[len(prompt) + j - 1, 123]), abs=1e-4)


def test_bf16_argmax_fast_path_matches_torch() -> None:
    from tokenmill.kernels import load_cpu_kernels

    ops = load_cpu_kernels()
    assert ops is not None
    torch.manual_seed(0)
    logits = torch.randn(9, 1003).bfloat16()
    logits[3, 17] = logits[3, 900] = 50.0  # ties: the first index wins, as in torch
    logits[4] = -1e30
    assert ops.argmax_rows(logits).tolist() == logits.float().argmax(dim=-1).tolist()
    rows = [row(SamplingParams(temperature=0.0)) for _ in range(9)]
    assert tokens(Sampler(ops), logits, rows) == tokens(Sampler(), logits, rows)
    # anything beyond plain greedy (here logprobs) takes the reference path
    rows[0] = row(SamplingParams(temperature=0.0, logprobs=2))
    assert Sampler(ops)(logits, metadata_for(rows)).logprobs[0] is not None


def test_plain_greedy_from_matches_what_plain_greedy_means() -> None:
    def plain(p: SamplingParams, n_out: int) -> bool:  # greedy with nothing that changes or reports logits
        return (p.temperature == 0.0 and p.logprobs is None and not p.logit_bias and p.presence_penalty == 0.0
                and p.frequency_penalty == 0.0 and p.repetition_penalty == 1.0 and n_out >= p.min_tokens)

    for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, min_tokens=2),
                   SamplingParams(temperature=0.7), SamplingParams(temperature=0.0, logprobs=0),
                   SamplingParams(temperature=0.0, logit_bias={3: 1.0}),
                   SamplingParams(temperature=0.0, repetition_penalty=1.1),
                   SamplingParams(temperature=0.0, presence_penalty=0.5, min_tokens=1)):
        for n_out in range(4):
            assert is_plain_greedy(row(params, [5, 6, 7], [8] * n_out)) == plain(params, n_out), (params, n_out)


def test_runner_samples_by_argmax_alone_only_while_every_row_is_plain_greedy(
        llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    # this module's engine is float32, where the C++ argmax does not apply: stand torch's in for it, so
    # that the sampler's choice between argmax alone and its full path is what is tested
    sampler = llm.engine.core.executor.runner.sampler
    monkeypatch.setattr(sampler, "argmax", lambda logits, bitmask=None: logits.argmax(dim=-1).tolist())
    calls: list[int] = []
    full_sampler = Sampler._choose  # the sampler's full path, past its argmax-alone shortcut

    def spy(logits: torch.Tensor, meta: SamplingMetadata) -> Any:
        calls.append(meta.num_rows)
        return full_sampler(logits, meta)

    monkeypatch.setattr(Sampler, "_choose", staticmethod(spy))
    prompts = random_prompts(2, 8, 8, seed=6)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    plain = llm.generate(prompts, greedy, use_tqdm=False)
    assert calls == []  # every step by argmax alone
    # min_tokens masks EOS for the first 3 tokens: those steps (and only those) need the full sampler
    mixed = llm.generate(prompts, [greedy, greedy.clone(min_tokens=3)], use_tqdm=False)
    assert calls == [2, 2, 2]
    # ignore_eos: masking changes nothing, so the tokens are those of the argmax path
    assert [o.outputs[0].token_ids for o in mixed] == [o.outputs[0].token_ids for o in plain]
    monkeypatch.undo()
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == [
        o.outputs[0].token_ids for o in plain]  # and those of the full sampler
