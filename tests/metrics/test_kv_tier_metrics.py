"""The second KV tier's counters in /metrics: hits per tier, bytes each way, damaged disk blocks, swaps;
absent while no tier moved anything. Its occupancy gauges per tier, in /metrics and the dashboard's
snapshot, only for the tiers that are on."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tokenmill.core.messages import SchedulerStats
from tokenmill.metrics.prometheus import EngineMetrics


def samples(m: EngineMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(m.render().decode()) for s in family.samples}


def test_tier_counters_follow_the_stats() -> None:
    m = EngineMetrics("m")
    m.scheduler_stats(SchedulerStats(num_total_blocks=4))
    assert not any(name.startswith("tokenmill:kv_offload") for name, _ in samples(m))
    m.scheduler_stats(SchedulerStats(kv_offload_memory_hits=16, kv_offload_bytes_offloaded=4096,
                                     kv_offload_bytes_loaded=2048, num_swapped_out=1))
    m.scheduler_stats(SchedulerStats(kv_offload_memory_hits=24, kv_offload_disk_hits=8, kv_offload_bytes_offloaded=8192,
                                     kv_offload_bytes_loaded=4096, kv_offload_corrupt_blocks=2, num_swapped_out=2,
                                     num_swapped_in=1))
    got = samples(m)
    model = ("model_name", "m")
    assert got[("tokenmill:kv_offload_hits_total", (model, ("tier", "memory")))] == 24
    assert got[("tokenmill:kv_offload_hits_total", (model, ("tier", "disk")))] == 8
    assert got[("tokenmill:kv_offload_bytes_total", (("direction", "out"), model))] == 8192
    assert got[("tokenmill:kv_offload_bytes_total", (("direction", "in"), model))] == 4096
    assert got[("tokenmill:kv_offload_corrupt_blocks_total", (model,))] == 2
    assert got[("tokenmill:num_swapped_total", (("direction", "out"), model))] == 2
    assert got[("tokenmill:num_swapped_total", (("direction", "in"), model))] == 1


def test_tier_occupancy_gauges_per_tier_that_is_on() -> None:
    m = EngineMetrics("m")
    m.scheduler_stats(SchedulerStats(num_total_blocks=4))
    assert not any(name.startswith("tokenmill:kv_offload") for name, _ in samples(m))
    assert m.live.snapshot(0.0)["kv_tiers"] == {}
    m.scheduler_stats(SchedulerStats(kv_offload_memory_blocks=3, kv_offload_memory_swap_blocks=2,
                                     kv_offload_memory_used_bytes=5 * 256, kv_offload_memory_capacity_bytes=8 * 256,
                                     kv_offload_memory_hits=16))
    got = samples(m)
    model, mem = ("model_name", "m"), ("tier", "memory")
    assert got[("tokenmill:kv_offload_blocks", (model, ("state", "cached"), mem))] == 3
    assert got[("tokenmill:kv_offload_blocks", (model, ("state", "swap"), mem))] == 2
    assert got[("tokenmill:kv_offload_used_bytes", (model, mem))] == 5 * 256
    assert got[("tokenmill:kv_offload_capacity_bytes", (model, mem))] == 8 * 256
    assert not any(dict(labels).get("tier") == "disk" for _, labels in got)
    assert m.live.snapshot(0.0)["kv_tiers"] == {"memory": {"cached_blocks": 3, "swap_blocks": 2, "used_bytes": 1280,
                                                           "capacity_bytes": 2048, "hit_tokens": 16}}
    m.scheduler_stats(SchedulerStats(kv_offload_disk_blocks=7, kv_offload_disk_used_bytes=7000,
                                     kv_offload_disk_capacity_bytes=10_000))
    got = samples(m)
    disk = ("tier", "disk")
    assert got[("tokenmill:kv_offload_blocks", (model, ("state", "cached"), disk))] == 7
    assert got[("tokenmill:kv_offload_used_bytes", (model, disk))] == 7000
    assert ("tokenmill:kv_offload_capacity_bytes", (model, mem)) not in got  # the memory tier is off now


def test_structured_output_counters_survive_stats_without_them() -> None:
    m = EngineMetrics("m")
    m.scheduler_stats(SchedulerStats(structured_requests={"json": 2}, grammar_compiles=1, grammar_compile_seconds=0.5))
    m.scheduler_stats(SchedulerStats())  # e.g. a message made without the grammar backend's counts
    m.scheduler_stats(SchedulerStats(structured_requests={"json": 3, "regex": 1}, grammar_compiles=2,
                                     grammar_compile_seconds=0.75, structured_failed=1))
    got = samples(m)
    model = ("model_name", "m")
    assert got[("tokenmill:structured_output_requests_total", (("kind", "json"), model))] == 3
    assert got[("tokenmill:structured_output_requests_total", (("kind", "regex"), model))] == 1
    assert got[("tokenmill:grammar_compilations_total", (model,))] == 2
    assert got[("tokenmill:grammar_compile_seconds_total", (model,))] == 0.75
    assert got[("tokenmill:structured_output_failed_requests_total", (model,))] == 1
