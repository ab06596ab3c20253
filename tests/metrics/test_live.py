"""The live figures of /metrics and /dashboard (metrics/live.py): the step window's rates, MBU/MFU
against the ceilings (never above 1), goodput under the SLO, KV blocks by state, the vLLM aliases."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tokenmill.core.messages import SchedulerStats, StepStats
from tokenmill.metrics import EngineMetrics
from tokenmill.metrics.ceilings import Ceilings
from tokenmill.metrics.live import percentile
from tokenmill.metrics.slo import SLO
from tokenmill.metrics.step_cost import PlanFigures
from tokenmill.metrics.vllm_aliases import VLLM_NAMES
from tokenmill.outputs import CompletionOutput, RequestOutput


def stats(steps: int, busy: float, nbytes: float, flops: float, **kv: int) -> SchedulerStats:
    return SchedulerStats(num_running=2, num_waiting=1, num_total_blocks=100, num_free_blocks=kv.get("free", 60),
                          num_cached_free_blocks=kv.get("cached", 10),
                          step=StepStats(steps, busy, 10 * steps, 2 * steps, nbytes, flops, 10, 2, 0.01))


def samples(metrics: EngineMetrics) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def test_window_rates_mbu_mfu_and_kv_blocks() -> None:
    m = EngineMetrics("m")
    m.live.configure(Ceilings(10.0, 100.0, "given", "given"), None, PlanFigures(2.0, 256, 4096, 16, 16))
    m.scheduler_stats(stats(1, 0.5, 1e9, 1e10), now=100.0)
    m.scheduler_stats(stats(11, 1.5, 6e9, 6e10), now=101.0)  # 10 steps, 1 s busy, 5 GB, 50 GFLOP
    m.scheduler_stats(SchedulerStats(num_running=2, num_waiting=1, num_total_blocks=100, num_free_blocks=60,
                                     num_cached_free_blocks=10), now=101.0)  # an abort's stats: no step counters
    got = samples(m)
    assert got["tokenmill:memory_bandwidth_bytes_per_second"] == pytest.approx(5e9)
    assert got["tokenmill:model_bandwidth_utilization"] == pytest.approx(0.5)
    assert got["tokenmill:flops_per_second"] == pytest.approx(5e10)
    assert got["tokenmill:model_flops_utilization"] == pytest.approx(0.5)
    assert got["tokenmill:step_time_seconds"] == pytest.approx(0.1)
    assert got["tokenmill:step_prefill_tokens_per_step"] == 10 and got["tokenmill:step_decode_tokens_per_step"] == 2
    assert got["tokenmill:kv_cache_blocks{state=used}"] == 40
    assert got["tokenmill:kv_cache_blocks{state=cached}"] == 10 and got["tokenmill:kv_cache_blocks{state=free}"] == 50
    assert got["tokenmill:step_bytes_total"] == 6e9
    assert got["tokenmill:roofline_ceiling_raised{resource=bandwidth}"] == 0
    assert got["tokenmill:plan_decode_floor_seconds"] == pytest.approx(2e-3)
    snap = m.live.snapshot(101.0)
    assert snap["mbu"] == pytest.approx(0.5) and snap["kv_blocks"]["used"] == 40 and snap["composition"][-1] == (10, 2)


def test_a_rate_above_the_ceiling_raises_it() -> None:
    m = EngineMetrics("m")
    m.live.configure(Ceilings(1.0, 1.0, "given", "given"), None, None)
    m.scheduler_stats(stats(1, 0.0, 0.0, 0.0), now=10.0)
    m.scheduler_stats(stats(2, 1.0, 5e9, 5e9), now=11.0)
    got = samples(m)
    assert got["tokenmill:model_bandwidth_utilization"] == 1.0 and got["tokenmill:model_flops_utilization"] == 1.0
    assert got["tokenmill:roofline_ceiling_raised{resource=bandwidth}"] == 1
    assert got["tokenmill:roofline_memory_bandwidth_bytes_per_second"] == pytest.approx(5e9)


def test_no_step_stats_no_step_metrics() -> None:
    m = EngineMetrics("m")
    m.scheduler_stats(SchedulerStats(num_total_blocks=8, num_free_blocks=8), now=1.0)
    got = samples(m)
    assert "tokenmill:model_bandwidth_utilization" not in got and "tokenmill:step_bytes_total" not in got
    assert m.live.snapshot(1.0)["stats_enabled"] is False


def test_slo_parsing() -> None:
    assert SLO.parse("ttft_ms=500,tpot_ms=50") == SLO(0.5, 0.05)
    assert SLO.parse("tpot_ms=20") == SLO(None, 0.02) and SLO.parse(None) is None
    for bad in ("ttft=5", "ttft_ms=x", "ttft_ms=-1", "ttft_ms"):
        with pytest.raises(ValueError, match="--slo"):
            SLO.parse(bad)
    slo = SLO(0.5, 0.05)
    assert slo.met(0.4, 0.04) and not slo.met(0.6, 0.01) and not slo.met(0.1, 0.06) and not slo.met(None, None)


def output(rid: str, tokens: list[int], finished: bool) -> RequestOutput:
    comp = CompletionOutput(0, "", tokens, finish_reason="length" if finished else None)
    return RequestOutput(rid, None, [1, 2, 3], [comp], finished)


def test_goodput_counts_requests_meeting_the_slo() -> None:
    m = EngineMetrics("m")
    m.live.configure(None, SLO(0.5, 0.1), None)
    m.live.start = 0.0
    for rid, ttft, step in (("fast", 0.1, 0.05), ("slow-first", 0.9, 0.05), ("slow-decode", 0.1, 0.3)):
        m.request_added(rid, 10.0, 3)
        m.output(output(rid, [5], False), 10.0 + ttft)
        m.output(output(rid, [6], False), 10.0 + ttft + step)
        m.output(output(rid, [7], True), 10.0 + ttft + 2 * step)
    m.request_added("gone", 10.0, 3)
    m.request_finished("gone", "abort", 11.0)  # not judged
    g = m.live.goodput(20.0)
    assert g is not None and (g["requests"], g["met"]) == (3, 1) and g["attainment"] == pytest.approx(1 / 3)
    assert g["goodput_rps"] == pytest.approx(1 / 20.0)
    got = samples(m)
    assert got["tokenmill:slo_met_requests_total"] == 1 and got["tokenmill:slo_requests_total"] == 3
    lat = m.live.percentiles(20.0)
    assert lat["ttft"]["n"] == 3 and lat["ttft"]["p50"] == pytest.approx(100.0)
    assert lat["itl"]["n"] == 6 and lat["tpot"]["p99"] == pytest.approx(300.0)
    assert m.live.snapshot(20.0)["generation_tokens"] == 9


def test_percentile_is_nearest_rank() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.0 and percentile([1.0, 2.0, 3.0, 4.0], 99) == 4.0
    assert percentile([7.0], 90) == 7.0


def test_vllm_aliases_carry_the_same_samples() -> None:
    m = EngineMetrics("m")
    m.scheduler_stats(SchedulerStats(num_running=3, num_waiting=2, kv_cache_usage=0.25), now=1.0)
    m.request_added("r", 1.0, 4)
    m.output(output("r", [5, 6], True), 1.5)
    got = samples(m)
    assert got["vllm:num_requests_running"] == got["tokenmill:num_requests_running"] == 3
    assert got["vllm:gpu_cache_usage_perc"] == got["vllm:kv_cache_usage_perc"] == 0.25
    assert got["vllm:generation_tokens_total"] == got["tokenmill:generation_tokens_total"] == 2
    assert got["vllm:time_to_first_token_seconds_count"] == 1
    assert got["vllm:request_success_total{finished_reason=length}"] == 1
    assert all(name.startswith("tokenmill:") for name in VLLM_NAMES)
