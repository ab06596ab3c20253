"""A request that the engine cannot prepare or sample ends alone, with an error; the engine and every
other request go on (issue #27, item 1). Bad data is planted past validation, as a bug in validation
would let it through: SamplingParams' checks are switched off (its bounds now refuse every value
that would break the engine), or, where the engine core runs in its own process and validates what
it decodes, the API process's vocabulary check is."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.conftest import random_prompts
from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineArgs
from tokenmill.core.messages import EngineCoreOutput, EngineCoreRequest
from tokenmill.engine import input_processor
from tokenmill.engine.async_engine import AsyncLLM, RequestFailedError
from tokenmill.engine.core_client import CoreClient

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


class Faulty:
    """The model, raising on the given forward calls (1-based)."""

    def __init__(self, model: Any, fail_calls: set[int], message: str = "injected fault") -> None:
        self.model, self.fail_calls, self.message, self.calls = model, fail_calls, message, 0

    def __call__(self, *args: Any) -> Any:
        self.calls += 1
        if self.calls in self.fail_calls:
            raise RuntimeError(self.message)
        return self.model(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


@pytest.fixture
def validation_bug(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(SamplingParams, "_checks", lambda self: [])


def _planted(**fields: Any) -> SamplingParams:
    params = SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True)
    for name, value in fields.items():
        setattr(params, name, value)
    return params


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("bad", [{"top_k": 2**63}, {"seed": 2**70}])
@pytest.mark.usefixtures("validation_bug")
def test_a_request_that_cannot_be_prepared_fails_alone(llama_dir: str, async_scheduling: bool,
                                                        bad: dict[str, int]) -> None:
    llm = LLM(llama_dir, dtype="float32", kv_cache_memory="2MiB", block_size=8, async_scheduling=async_scheduling)
    prompts = random_prompts(4, 5, 30, seed=7)
    reference = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    params = [GREEDY, _planted(**bad), GREEDY, GREEDY]
    outs = llm.generate(prompts, params, use_tqdm=False)
    failed = outs[1].outputs[0]
    assert failed.finish_reason == "error" and failed.token_ids == []
    assert "could not be prepared" in str(failed.stop_reason)
    assert [o.outputs[0].token_ids for i, o in enumerate(outs) if i != 1] == [reference[0]] + reference[2:]
    core = llm.engine.core
    assert core.scheduler.kv.num_free_blocks == core.scheduler.kv.pool.num_blocks
    assert not core.executor.runner.failed  # forgotten once the scheduler reported it finished
    # and the engine serves on
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == reference


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_failed_step_ends_its_requests_and_the_engine_goes_on(llama_dir: str, async_scheduling: bool) -> None:
    llm = LLM(llama_dir, dtype="float32", kv_cache_memory="2MiB", block_size=8, async_scheduling=async_scheduling)
    prompts = random_prompts(3, 5, 30, seed=8)
    reference = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    runner = llm.engine.core.executor.runner
    runner.model = Faulty(runner.model, fail_calls={3})
    runner.fused_decode = None  # every step through the model
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert all(o.outputs[0].finish_reason == "error" and "injected fault" in str(o.outputs[0].stop_reason)
               for o in outs)
    core = llm.engine.core
    assert core.scheduler.kv.num_free_blocks == core.scheduler.kv.pool.num_blocks
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == reference


def test_steps_failing_in_a_row_stop_the_engine(llama_dir: str) -> None:
    llm = LLM(llama_dir, dtype="float32", kv_cache_memory="2MiB", block_size=8, async_scheduling=False)
    runner = llm.engine.core.executor.runner
    runner.model = Faulty(runner.model, fail_calls=set(range(1, 100)), message="broken model")
    runner.fused_decode = None
    prompts = random_prompts(3, 5, 10, seed=9)
    with pytest.raises(RuntimeError, match="broken model"):
        for p in prompts:  # one request a step: three failed steps in a row
            llm.generate([p], GREEDY, use_tqdm=False)


def test_the_server_front_end_fails_the_request_and_serves_the_others(llama_dir: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(input_processor, "check_token_ids", lambda ids, vocab_size, name: None)
    args = EngineArgs(llama_dir, dtype="float32", kv_cache_memory="8MiB", max_model_len=512)
    prompts = random_prompts(2, 5, 20, seed=10)

    async def main() -> tuple[str, list[int]]:
        engine = await AsyncLLM.from_engine_args(args)
        try:
            bad = engine.add_request(prompts[0], GREEDY.clone(logit_bias={10**6: 1.0}))  # the sampler indexes with it
            with pytest.raises(RequestFailedError) as failure:
                async for _ in bad:
                    pass
            tokens: list[int] = []
            async for out in engine.add_request(prompts[1], GREEDY):
                tokens = out.outputs[0].token_ids
            assert engine.is_healthy
            return str(failure.value), tokens
        finally:
            await engine.shutdown()

    message, tokens = asyncio.run(main())
    assert "the engine step failed" in message and len(tokens) == 12


def test_a_request_the_core_cannot_decode_fails_alone(llama_dir: str) -> None:
    # the core process validates SamplingParams again as it decodes each request: one that fails there
    # (sent past the front end's validation) ends alone, by its id, instead of ending the core
    args = EngineArgs(llama_dir, dtype="float32", kv_cache_memory="8MiB", max_model_len=512)
    prompt = random_prompts(1, 5, 20, seed=12)[0]
    bad = GREEDY.clone()
    bad.top_p = 7.0  # out of (0, 1]

    async def main() -> dict[str, EngineCoreOutput]:
        client = CoreClient(args)
        try:
            await client.wait_ready()
            client.add_requests([EngineCoreRequest("bad", prompt, bad), EngineCoreRequest("good", prompt, GREEDY)])
            last: dict[str, EngineCoreOutput] = {}
            while not ("good" in last and last["good"].finished):
                for out in (await asyncio.wait_for(client.get_output(), 60)).outputs:
                    last[out.request_id] = out
            return last
        finally:
            client.shutdown()

    last = asyncio.run(main())
    assert last["bad"].finish_reason == "error" and "could not be decoded" in str(last["bad"].stop_reason)
    assert "top_p" in str(last["bad"].stop_reason)
    assert last["good"].finish_reason == "length"
