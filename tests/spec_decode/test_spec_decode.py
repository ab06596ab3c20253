"""Speculative decoding end to end on a tiny Llama, with proposers installed on the model runner: drafts
that are always wrong change no token (greedy or seeded, through chunked prefill, prefix-cache hits and
preemption); drafts that are the true continuation change no token either and take several tokens a
step; stops inside an accepted run cut it where one token at a time would stop; no KV block is left
behind, aborted mid-speculation or not."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import random_prompts
from tests.fixtures import EOS, VOCAB
from tokenmill import LLM, SamplingParams
from tokenmill.spec_decode.proposer import ProposalInput

SHARED = random_prompts(1, 20, 20, seed=30)[0]  # a prefix of 2 full 8-token blocks and a half
PROMPTS = random_prompts(6, 3, 45, seed=31) + [SHARED + tail for tail in random_prompts(3, 2, 12, seed=32)]


def mixed_params() -> list[SamplingParams]:
    """Greedy of several kinds and seeded random, one per prompt."""
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    return [
        greedy, greedy.clone(max_tokens=9), SamplingParams(temperature=0.8, seed=5, max_tokens=20, ignore_eos=True),
        greedy.clone(repetition_penalty=2.0, frequency_penalty=1.5, presence_penalty=1.0, logprobs=2),
        greedy.clone(min_tokens=6, logit_bias={EOS: 40.0}, ignore_eos=False),  # EOS as soon as allowed
        SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=8, max_tokens=16, ignore_eos=True),
        greedy.clone(max_tokens=30), greedy.clone(max_tokens=5), greedy.clone(max_tokens=17),
    ]


class Garbage:
    """k random tokens for every request: rejected but for the odd coincidence."""

    def __init__(self, k: int, seed: int = 0) -> None:
        self.k, self.rng, self.calls = k, random.Random(seed), 0

    def propose(self, batch: ProposalInput) -> dict[str, list[int]]:
        self.calls += 1
        return {rid: [self.rng.randrange(2, VOCAB) for _ in range(self.k)] for rid in batch.req_ids}


class Oracle:
    """The next k tokens of whichever known sequence the request's tokens begin."""

    def __init__(self, sequences: list[list[int]], k: int) -> None:
        self.sequences, self.k = sequences, k

    def propose(self, batch: ProposalInput) -> dict[str, list[int]]:
        out = {}
        for rid, tokens in zip(batch.req_ids, batch.token_ids, strict=True):
            for seq in self.sequences:
                if len(seq) > len(tokens) and seq[:len(tokens)] == tokens:
                    out[rid] = seq[len(tokens):len(tokens) + self.k]
                    break
        return out


def engine(model_dir: str, **args: Any) -> LLM:
    return LLM(model_dir, dtype="float32", block_size=8, async_scheduling=False, **args)


def run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams], cold: bool = True
        ) -> tuple[list[Any], int]:
    """Each request's (tokens, finish reason, stop reason, text), and the engine steps they took; cold:
    from an empty prefix cache."""
    sched = llm.engine.core.scheduler
    if cold:
        assert llm.engine.reset_prefix_cache()
    steps = sched.num_steps
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert sched.kv.num_free_blocks == sched.kv.pool.num_blocks  # nothing left behind
    return [(c.token_ids, c.finish_reason, c.stop_reason, c.text) for c in (o.outputs[0] for o in outs)], (
        sched.num_steps - steps)


CONFIGS = {
    "mixed": dict(kv_cache_memory="8MiB"),
    "chunked_prefill": dict(kv_cache_memory="8MiB", max_num_batched_tokens=16, max_num_seqs=4),
    "preemption": dict(num_kv_blocks=14, max_model_len=96),  # the batch does not fit in 14 blocks of 8
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def configured(request: pytest.FixtureRequest, llama_dir: str) -> Iterator[tuple[str, LLM]]:
    llm = engine(llama_dir, **CONFIGS[request.param])
    yield request.param, llm
    llm.engine.core.executor.runner.set_proposer(None)


# how a step of decodes and verification runs is run: as it is scheduled (verification as prefill), or
# as decode rows (ModelRunner.verify_as_decode_rows, the fused decode path's input; here the layer loop)
VERIFY = [False, True]


@pytest.mark.parametrize("as_rows", VERIFY)
def test_wrong_drafts_change_no_token(configured: tuple[str, LLM], as_rows: bool) -> None:
    name, llm = configured
    runner, sched = llm.engine.core.executor.runner, llm.engine.core.scheduler
    runner.verify_as_decode_rows = as_rows
    runner.set_proposer(None)
    plain, _ = run(llm, PROMPTS, mixed_params())
    hits, preemptions = sched.kv.prefix_hits, sched.num_preemptions
    proposer = Garbage(3)
    runner.set_proposer(proposer)
    spec, _ = run(llm, PROMPTS, mixed_params(), cold=False)
    assert spec == plain and proposer.calls
    assert sched.kv.prefix_hits > hits  # the prompts cached by the first run were hit with drafts around
    if name == "preemption":
        assert sched.num_preemptions > preemptions


@pytest.mark.parametrize("as_rows", VERIFY)
def test_right_drafts_change_no_token_and_take_several_a_step(configured: tuple[str, LLM], as_rows: bool) -> None:
    llm = configured[1]
    runner = llm.engine.core.executor.runner
    runner.verify_as_decode_rows = as_rows
    runner.set_proposer(None)
    plain, plain_steps = run(llm, PROMPTS, mixed_params())
    runner.set_proposer(Oracle([p + tokens for p, (tokens, *_) in zip(PROMPTS, plain, strict=True)], 4))
    spec, steps = run(llm, PROMPTS, mixed_params())
    assert spec == plain
    assert steps < 0.6 * plain_steps, (steps, plain_steps)


def test_a_stop_inside_an_accepted_run_cuts_it_where_one_token_at_a_time_would(llama_dir: str) -> None:
    llm = engine(llama_dir, kv_cache_memory="8MiB")
    runner = llm.engine.core.executor.runner
    prompts = PROMPTS[:4]
    free = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    full, _ = run(llm, prompts, [free] * 4)
    stop_token, stop_text = full[1][0][5], full[3][3][-8:-5]
    params = [free.clone(max_tokens=5), free.clone(stop_token_ids=[stop_token]),
              free.clone(ignore_eos=False, logit_bias={EOS: 40.0}, min_tokens=7),
              free.clone(stop=[stop_text])]  # a stop string: the front end cuts the run there
    plain, plain_steps = run(llm, prompts, params)
    assert plain[1][0][-1] == stop_token and plain[1][1:3] == ("stop", stop_token)
    assert plain[2][0][-1] == EOS and len(plain[2][0]) == 8 and plain[0][1] == "length"
    assert plain[3][1:3] == ("stop", stop_text) and len(plain[3][0]) < 30
    runner.set_proposer(Oracle([p + tokens for p, (tokens, *_) in zip(prompts, full, strict=True)], 8))
    spec, steps = run(llm, prompts, params)
    assert spec == plain and steps < plain_steps


def test_no_block_is_left_behind_when_requests_are_aborted_mid_speculation(llama_dir: str) -> None:
    llm = engine(llama_dir, num_kv_blocks=40, max_model_len=128)
    core, runner = llm.engine.core, llm.engine.core.executor.runner
    runner.set_proposer(Garbage(5))
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    ids = [llm.engine.add_request(None, {"prompt_token_ids": p}, params) for p in PROMPTS[:6]]
    for _ in range(4):
        llm.engine.step()
    assert all(r.spec_token_ids for r in core.scheduler.running)  # drafts for the next step
    llm.engine.abort_request(ids[:3])
    llm.engine.step()
    llm.engine.abort_request(ids[3:5])
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert core.scheduler.kv.num_free_blocks == 40 and not core.scheduler.kv.req_blocks


def test_a_seeded_random_run_with_drafts_is_reproducible_and_the_same_as_without(llama_dir: str) -> None:
    llm = engine(llama_dir, kv_cache_memory="8MiB")
    runner = llm.engine.core.executor.runner
    params = [SamplingParams(temperature=1.0, top_p=0.95, seed=40 + i, max_tokens=20, ignore_eos=True)
              for i in range(len(PROMPTS))]
    plain, _ = run(llm, PROMPTS, params)
    runs = []
    for _ in range(2):
        runner.set_proposer(Oracle([p + t for p, (t, *_) in zip(PROMPTS, plain, strict=True)], 3))
        runs.append(run(llm, PROMPTS, params))
        runner.set_proposer(Garbage(2, seed=7))
        runs.append(run(llm, PROMPTS, params))
    assert all(tokens == plain for tokens, _ in runs)
    assert runs[0][1] < runs[1][1]  # the seeded stream's own continuation was accepted


def test_with_async_scheduling_drafts_come_only_while_steps_run_one_at_a_time(llama_dir: str) -> None:
    """Speculation keeps async scheduling: above the adaptive rule's max_batch_size the steps overlap and
    nothing is proposed; at or below it (the batch's tail) each step's output is in before the next is
    scheduled and drafts are verified. Greedy tokens are those of the same engine without speculation."""
    prompts = [p * 3 for p in random_prompts(10, 4, 8, seed=33)]  # repeats: prompt lookup finds drafts
    params = [SamplingParams(temperature=0.0, max_tokens=8 + 4 * i, ignore_eos=True) for i in range(len(prompts))]
    common = dict(dtype="float32", kv_cache_memory="8MiB", block_size=8, async_scheduling=True)
    plain = [o.outputs[0].token_ids for o in LLM(llama_dir, **common).generate(prompts, params, use_tqdm=False)]
    llm = LLM(llama_dir, **common, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                       "max_batch_size": 3})
    core = llm.engine.core
    assert llm.engine.config.scheduler.async_scheduling
    overlapped, submit = [], core._submit

    def counting_submit() -> None:
        submit()
        overlapped.append(len(core._in_flight))
        # a step scheduled behind another proposes nothing; a step that verifies drafts has none behind it
        assert not core._in_flight[-1][0].propose_drafts
        if len(core._in_flight) == 2:
            assert not core._in_flight[0][0].scheduled_spec_decode_tokens

    core._submit = counting_submit  # type: ignore[method-assign]
    spec = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert spec == plain
    assert max(overlapped) == 2 and core.scheduler.spec.num_draft_tokens > 0
    assert core.scheduler.kv.num_free_blocks == core.scheduler.kv.pool.num_blocks


def test_steps_overlap_while_the_cost_gate_keeps_a_batch_size_plain(llama_dir: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Within max_batch_size, a step whose proposal the cost gate refused reports it (spec_gated), the engine
    overlaps the next steps (async scheduling, no proposals), and the first proposal after them is a probe
    (ProposalInput.resumed) that drafts. Greedy tokens are those of the same engine without speculation."""
    from tokenmill.spec_decode.adaptive import GATE_PROBE_EVERY, CostGate

    prompts = [p * 3 for p in random_prompts(3, 4, 8, seed=35)]  # repeats: prompt lookup finds drafts
    params = [SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True) for _ in prompts]
    common = dict(dtype="float32", kv_cache_memory="8MiB", block_size=8, async_scheduling=True)
    plain = [o.outputs[0].token_ids for o in LLM(llama_dir, **common).generate(prompts, params, use_tqdm=False)]
    decisions: list[bool] = []

    def refusing(self: CostGate, batch: int, resumed: bool = False) -> bool:
        decisions.append(resumed)
        return resumed  # plain, except the probe after overlapped steps

    monkeypatch.setattr(CostGate, "pays", refusing)
    llm = LLM(llama_dir, **common, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    core = llm.engine.core
    overlapped, submit = [0], core._submit

    def counting_submit() -> None:
        submit()
        overlapped[0] += 1

    core._submit = counting_submit  # type: ignore[method-assign]
    spec = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert spec == plain
    # a batch of 3 is within max_batch_size (32): only the refusals let steps overlap
    assert overlapped[0] >= GATE_PROBE_EVERY
    assert True in decisions and False in decisions  # probes after overlapped steps, refusals otherwise
    assert core.scheduler.spec.num_draft_tokens > 0  # the probes drafted
    assert core.scheduler.kv.num_free_blocks == core.scheduler.kv.pool.num_blocks
