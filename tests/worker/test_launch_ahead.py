"""ModelRunner.launch (pure-decode greedy steps queued by the preparing thread, their pending inputs taken
from the device tensor of the step before) against transformers and against the worker-thread path. On a
GPU it runs behind CUDA graphs; here it is turned on over the CPU, where the same code runs eagerly."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.conftest import random_prompts
from tests.models.test_golden import expected, run
from tokenmill import LLM, SamplingParams


def _llm(model_dir: str, launch_ahead: bool, **kw: Any) -> LLM:
    llm = LLM(model_dir, dtype="float32", kv_cache_memory="16MiB", device="cpu", async_scheduling=True,
              block_size=16, **kw)
    llm.engine.core.executor.worker.model_runner.launch_ahead = launch_ahead
    return llm


def _launched(llm: LLM) -> int:
    return int(llm.engine.core.executor.worker.model_runner.launched)


def _slow_finish(llm: LLM, seconds: float) -> None:
    """The worker thread records each launched step's tokens `seconds` late, so that the next step is
    launched before they are on the host and takes them on the device (as behind a GPU's step)."""
    runner = llm.engine.core.executor.worker.model_runner
    finish = runner.finish

    def late(launched: Any) -> Any:
        time.sleep(seconds)
        return finish(launched)

    runner.finish = late


@pytest.mark.parametrize("late_s", [0.0, 0.01], ids=["host-inputs", "device-inputs"])
def test_launched_decode_steps_match_transformers(llama_dir: str, late_s: float) -> None:
    # prompts of different lengths and budgets: requests join and leave, so launched decode steps alternate
    # with mixed steps that the worker thread runs (chunks of 24 tokens split the longer prompts)
    llm = _llm(llama_dir, True, max_num_batched_tokens=24, max_num_seqs=4)
    if late_s:
        _slow_finish(llm, late_s)
    prompts = random_prompts(7, 3, 50, seed=3)
    max_tokens = [12, 30, 5, 22, 17, 9, 26]
    assert run(llm, prompts, max_tokens) == expected(llama_dir, prompts, max_tokens)
    assert _launched(llm) > 20
    # one request alone: after its prefill, every step is launched behind the one before
    before = _launched(llm)
    assert run(llm, prompts[:1], [40]) == expected(llama_dir, prompts[:1], [40])
    assert _launched(llm) - before >= 35
    if late_s:
        assert llm.engine.core.executor.worker.model_runner.device_inputs > 30


def test_sampled_requests_beside_greedy_ones_run_on_the_worker_thread(llama_dir: str) -> None:
    # a seeded sampled request makes its steps unlaunchable; once it ends the greedy ones launch again.
    # Outputs equal the worker-thread path's, seeded tokens included
    prompts = random_prompts(3, 5, 20, seed=4)
    params = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=25, ignore_eos=True)]
    outs = {}
    for launch_ahead in (False, True):
        llm = _llm(llama_dir, launch_ahead, max_num_seqs=4)
        _slow_finish(llm, 0.005)
        outs[launch_ahead] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert (_launched(llm) > 10) is launch_ahead
    assert outs[True] == outs[False]


def test_a_step_is_not_launched_while_the_worker_thread_samples_its_inputs(llama_dir: str) -> None:
    # launch() refuses (returns None) a step whose pending token neither the host nor the last launched step
    # holds; the executor waits for the worker thread's step and then launches it
    llm = _llm(llama_dir, True, max_num_seqs=2)
    runner = llm.engine.core.executor.worker.model_runner
    refused = []
    launch = runner.launch

    def counting(prepared: Any) -> Any:
        result = launch(prepared)
        if result is None:
            refused.append(prepared)
        return result

    runner.launch = counting
    _slow_finish(llm, 0.005)
    prompts = random_prompts(2, 8, 30, seed=5)
    assert run(llm, prompts, [20, 20]) == expected(llama_dir, prompts, [20, 20])
    assert not refused  # the executor waited for the worker thread's steps before each launch
    assert runner.launched >= 15 and runner.device_inputs > 0
