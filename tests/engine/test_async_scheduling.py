"""Async scheduling (the default) against the synchronous engine, its reference: the same outputs for
every kind of request, through preemption, stops of every kind and sampling that reads the history.
(The golden tests check the async engine's greedy tokens against transformers.)"""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import random_prompts
from tokenmill import LLM, SamplingParams, config
from tokenmill.config import EngineArgs

PROMPTS = random_prompts(10, 3, 40, seed=5)


def engine(model_dir: str, async_scheduling: bool) -> LLM:
    # 12 blocks of 8 tokens: the batch does not fit, so requests are preempted and resumed
    return LLM(model_dir, dtype="float32", num_kv_blocks=12, block_size=8, max_model_len=96,
               async_scheduling=async_scheduling)


@pytest.fixture(scope="module")
def engines(llama_dir: str) -> tuple[LLM, LLM]:
    return engine(llama_dir, False), engine(llama_dir, True)


def params(sync_llm: LLM) -> list[SamplingParams]:
    # a stop string and a stop token taken from what the model says, so that both really stop it
    probe = sync_llm.generate([PROMPTS[6], PROMPTS[7]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                              use_tqdm=False)
    stop_text = probe[0].outputs[0].text[-6:-3]
    stop_token = probe[1].outputs[0].token_ids[6]
    return [
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=25, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=10, logprobs=3, prompt_logprobs=2, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30, min_tokens=4, logit_bias={0: 60.0}),  # EOS after 4
        SamplingParams(temperature=0.7, presence_penalty=1.0, repetition_penalty=1.3, seed=9, max_tokens=24,
                       ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, stop=[stop_text], ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_token], ignore_eos=True),
        SamplingParams(n=2, temperature=1.0, seed=4, max_tokens=15, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
    ]


def summary(outs: list[Any]) -> list[Any]:
    """Everything but the logprob values (batches differ, so float32 sums may differ in the last bits)."""
    def ranks(positions: list[Any] | None) -> list[Any] | None:
        return None if positions is None else [p and {t: lp.rank for t, lp in p.items()} for p in positions]

    return [(ranks(o.prompt_logprobs), [(c.token_ids, c.text, c.finish_reason, c.stop_reason, ranks(c.logprobs))
                                        for c in o.outputs]) for o in outs]


def logprob_values(outs: list[Any]) -> list[float]:
    return [lp.logprob for o in outs for positions in [o.prompt_logprobs or []] + [c.logprobs or [] for c in o.outputs]
            for p in positions if p for lp in p.values()]


def test_async_outputs_are_the_synchronous_ones(engines: tuple[LLM, LLM]) -> None:
    sync_llm, async_llm = engines
    assert not sync_llm.engine.config.scheduler.async_scheduling and async_llm.engine.config.scheduler.async_scheduling
    sp = params(sync_llm)
    want = sync_llm.generate(PROMPTS, sp, use_tqdm=False)
    got = async_llm.generate(PROMPTS, sp, use_tqdm=False)
    assert summary(got) == summary(want)
    assert logprob_values(got) == pytest.approx(logprob_values(want), abs=1e-5)
    assert len(logprob_values(got)) > 50
    reasons = {c.finish_reason for o in got for c in o.outputs}
    assert reasons == {"length", "stop"}
    assert [len(c.token_ids) for c in got[4].outputs] == [5]  # 4 tokens, then EOS
    assert got[6].outputs[0].finish_reason == "stop" and got[7].outputs[0].finish_reason == "stop"
    for llm in engines:
        core = llm.engine.core
        assert core.scheduler.num_preemptions > 0
        assert not core.has_unfinished_requests() and core.scheduler.kv.num_free_blocks == 12


def test_async_engine_keeps_two_steps_in_flight(engines: tuple[LLM, LLM]) -> None:
    _, async_llm = engines
    core = async_llm.engine.core
    depth: list[int] = []
    submit = core._submit

    def watched() -> None:
        submit()
        depth.append(len(core._in_flight))

    core._submit = watched  # type: ignore[method-assign]
    try:
        async_llm.generate(PROMPTS[:3], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    finally:
        del core._submit
    assert max(depth) == 2


@pytest.mark.parametrize(("cpus", "threads", "busy", "device", "on"), [
    (2, 1, 0, "cpu", True),  # offline, one compute thread: the second CPU schedules
    (2, None, 0, "cpu", False),  # compute threads on every CPU
    (2, 1, 1, "cpu", False),  # serving: the second CPU is the API process's
    (8, 4, 1, "cpu", True),
    (2, None, 1, "cuda", True),
])
def test_async_scheduling_default_wants_a_cpu_of_its_own(monkeypatch: pytest.MonkeyPatch, cpus: int,
                                                         threads: int | None, busy: int, device: str,
                                                         on: bool) -> None:
    monkeypatch.setattr(config, "default_num_threads", lambda: cpus)
    assert config.default_async_scheduling(device, threads, busy) is on


def test_async_scheduling_flag_overrides_the_default(llama_dir: str) -> None:
    # on the CPU (a GPU's default is on): more compute threads than CPUs leave none for scheduling
    for flag in (True, False):
        cfg = EngineArgs(llama_dir, device="cpu", num_threads=4096, async_scheduling=flag).create_engine_config()
        assert cfg.scheduler.async_scheduling is flag
    cfg = EngineArgs(llama_dir, device="cpu", num_threads=4096).create_engine_config()
    assert not cfg.scheduler.async_scheduling
