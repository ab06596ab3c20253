"""AsyncLLM, the server's engine front end, with its engine core in its own process: what a
RequestOutput carries besides tokens (scheduling times, prefix-cache hits) crosses the wire."""

from __future__ import annotations

import asyncio

import pytest

from tests.conftest import random_prompts
from tests.engine.test_llm_api import assert_queued_after
from tokenmill import RequestOutput, SamplingParams
from tokenmill.config import EngineArgs
from tokenmill.engine.async_engine import AsyncLLM
from tokenmill.sampling_params import RequestOutputKind


def test_queued_request_metrics_and_cached_tokens(llama_dir: str) -> None:
    args = EngineArgs(llama_dir, dtype="float32", kv_cache_memory="8MiB", max_model_len=512, max_num_seqs=1,
                      block_size=16)
    a = random_prompts(1, 80, 80, seed=41)[0]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)

    async def main() -> tuple[list[RequestOutput], bytes]:
        engine = await AsyncLLM.from_engine_args(args)
        try:
            streams = [engine.add_request(p, params) for p in (a, a + [7])]  # one event-loop turn: one batch
            outs = []
            for stream in streams:
                async for out in stream:
                    outs.append(out)  # FINAL_ONLY: one output each
            return outs, engine.metrics.render()
        finally:
            await engine.shutdown()

    (out_a, out_b), metrics = asyncio.run(main())
    assert_queued_after(out_a, out_b)
    queued = [ln for ln in metrics.decode().splitlines() if ln.startswith("tokenmill:request_queue_time_seconds_count")]
    assert len(queued) == 1 and float(queued[0].split()[-1]) == 2.0  # observed once per request


def test_failed_admission_gives_back_its_capacity(llama_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A request that fails after it was counted (it cannot be encoded for the core, or the send
    fails) raises ValueError and leaves no trace: with room for two sequences and no queue, two
    such failures once left an idle engine refusing every request as full."""
    args = EngineArgs(llama_dir, dtype="float32", kv_cache_memory="8MiB", max_model_len=512, max_num_seqs=2)
    params = SamplingParams(temperature=0, max_tokens=2, output_kind=RequestOutputKind.FINAL_ONLY)

    async def main() -> list[str]:
        engine = await AsyncLLM.from_engine_args(args, max_queue_len=0)
        try:
            errors = []
            surrogate = params.clone()
            surrogate.stop = ["\ud800"]  # planted: SamplingParams itself refuses it
            for prompt, p, priority in [("x", surrogate, 0), ("x", params, 2**64), ("x", params, -(2**63) - 1)]:
                with pytest.raises(ValueError) as info:
                    engine.add_request(prompt, p, priority=priority)
                errors.append(str(info.value))
            with monkeypatch.context() as m:
                m.setattr(engine.client, "add_requests", _fail_send)
                for _ in range(3):
                    with pytest.raises(OSError):
                        engine.add_request("x", params)
            assert engine.num_unfinished_requests == 0 and not engine.output_processor.parents
            streams = [engine.add_request("x", params), engine.add_request("y", params)]  # both fit
            for stream in streams:
                async for out in stream:
                    assert out.finished
            assert engine.num_unfinished_requests == 0 and not engine.output_processor.parents
            assert b'finished_reason="error"' not in engine.metrics.render()
            return errors
        finally:
            await engine.shutdown()

    errors = asyncio.run(main())
    assert errors[0].startswith("stop") and "surrogate" in errors[0]
    assert all(e.startswith("priority") and "64-bit" in e for e in errors[1:])


def _fail_send(requests: object) -> None:
    raise OSError("the send failed")


def test_batch_lines_do_not_take_the_interactive_queues_room(llama_dir: str) -> None:
    """With room for two sequences and no queue, batch-class requests (bounded by their runner) are not
    counted: interactive ones are still admitted, and a third interactive one is refused as full."""
    from tokenmill.core.request import PriorityClass
    from tokenmill.engine.async_engine import QueueFullError

    args = EngineArgs(llama_dir, dtype="float32", kv_cache_memory="8MiB", max_model_len=512, max_num_seqs=2)
    params = SamplingParams(temperature=0, max_tokens=2, output_kind=RequestOutputKind.FINAL_ONLY)

    async def main() -> None:
        engine = await AsyncLLM.from_engine_args(args, max_queue_len=0)
        try:
            streams = [engine.add_request(f"b{i}", params, priority_class=PriorityClass.BATCH, group="g")
                       for i in range(4)]
            streams += [engine.add_request("x", params), engine.add_request("y", params)]
            with pytest.raises(QueueFullError):
                engine.add_request("z", params)
            for stream in streams:
                async for out in stream:
                    assert out.finished and out.outputs[0].finish_reason == "length"
        finally:
            await engine.shutdown()

    asyncio.run(main())
