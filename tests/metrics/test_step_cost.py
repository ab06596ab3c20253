"""The engine's per-step work (engine/step_meter.py over metrics/step_cost.py) against the benches'
arithmetic on the same step, and the step meter's counters on a real engine."""

from __future__ import annotations

import pytest

from tokenmill.arch import load_arch_config
from tokenmill.bench.latency import roofline_fields
from tokenmill.core.request import Request
from tokenmill.core.sched_output import SchedulerOutput
from tokenmill.engine.step_meter import StepMeter
from tokenmill.metrics.ceilings import Ceilings, utilization
from tokenmill.metrics.step_cost import attended_positions, step_bytes, step_flops
from tokenmill.model_math import ModelCost
from tokenmill.sampling_params import SamplingParams


def step(**scheduled: int) -> SchedulerOutput:
    return SchedulerOutput([], [], dict(scheduled), sum(scheduled.values()))


def request(rid: str, prompt_len: int, computed: int) -> Request:
    req = Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=8), ())
    req.num_computed_tokens = computed
    return req


@pytest.fixture
def cost(llama_dir: str) -> ModelCost:
    return ModelCost(load_arch_config(llama_dir), "bfloat16")


def test_attended_positions_is_the_causal_sum() -> None:
    assert attended_positions(10, 1) == 10
    assert attended_positions(10, 10) == sum(range(1, 11))
    assert attended_positions(12, 4) == 9 + 10 + 11 + 12


def test_a_decode_step_costs_what_bench_latency_counts(cost: ModelCost) -> None:
    meter = StepMeter(cost)
    reqs = {f"r{i}": request(f"r{i}", 20, 26) for i in range(3)}  # after the step: 26 tokens of KV each
    so = step(r0=1, r1=1, r2=1)
    meter.scheduled(so, reqs, 0.0)
    meter.finished(so)
    s = meter.stats
    assert (s.steps, s.prefill_tokens, s.decode_tokens, s.last_decode_tokens) == (1, 0, 3, 3)
    # bench latency's bytes per step at batch 3 and context 26, and its MBU from the same figures
    assert s.bytes == cost.decode_bytes(3, 26)
    assert s.flops == cost.decode_flops(3, 26)
    fields = roofline_fields(cost, Ceilings(10.0, 100.0, "given", "given"), 3, 26, 60, 1.0, s.busy_s)
    assert fields["bytes_per_step"] == s.bytes
    mbu = utilization(s.bytes / s.busy_s / 1e9, 10.0).ratio
    assert fields["mbu"] == pytest.approx(mbu, rel=1e-3)


def test_a_whole_prefill_costs_what_the_throughput_bench_counts(cost: ModelCost) -> None:
    meter = StepMeter(cost)
    so = step(a=24)
    meter.scheduled(so, {"a": request("a", 24, 24)}, 0.0)
    meter.finished(so)
    assert meter.stats.prefill_tokens == 24 and meter.stats.decode_tokens == 0
    assert meter.stats.flops == pytest.approx(24 * cost.prefill_flops_per_token(24))
    assert meter.stats.bytes == step_bytes(cost, 24, 24)


def test_chunks_and_mixed_steps(cost: ModelCost) -> None:
    meter = StepMeter(cost)
    # a's first chunk of 16 (of 40), b a decode at 31 tokens: one sampled row (b)
    so = step(a=16, b=1)
    meter.scheduled(so, {"a": request("a", 40, 16), "b": request("b", 30, 31)}, 0.0)
    meter.finished(so)
    s = meter.stats
    assert (s.last_prefill_tokens, s.last_decode_tokens) == (16, 1)
    assert s.flops == step_flops(cost, 17, 1, attended_positions(16, 16) + 31)
    assert s.bytes == step_bytes(cost, 17, 16 + 31)


def test_dropped_and_empty_steps_count_nothing(cost: ModelCost) -> None:
    meter = StepMeter(cost)
    so = step(a=1)
    meter.scheduled(so, {"a": request("a", 4, 5)}, 0.0)
    meter.dropped(so)
    meter.finished(so)
    empty = step()
    meter.scheduled(empty, {}, 0.0)
    meter.finished(empty)
    assert meter.snapshot().steps == 0 and meter.snapshot().bytes == 0


def test_utilization_never_exceeds_one() -> None:
    assert utilization(5.0, 10.0) == utilization(5.0, 10.0)
    u = utilization(12.0, 10.0)
    assert (u.ratio, u.ceiling, u.raised) == (1.0, 12.0, True)
    u = utilization(5.0, 10.0)
    assert (u.ratio, u.raised) == (0.5, False)
