"""The engine's live figures over a recent window: achieved bandwidth and FLOP/s of the steps with MBU and
MFU against the roofline's ceilings, batch composition, KV blocks by state, goodput under the SLO,
latency percentiles and throughput over the last minutes, and `tokenmill plan`'s floor beside them.

Fed per step with the core's SchedulerStats (a reference kept, a tuple appended to a bounded deque at
most every SAMPLE_S, one per step for the composition) and per request with its latencies; everything
else is computed when /metrics is scraped (`collect`, a Prometheus collector) or the dashboard asks
(`snapshot`). The step window's rates divide by the steps' busy time, as `bench latency` divides by
the decode time: what the engine achieves while it runs, not diluted by idle seconds.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from tokenmill.core.messages import SchedulerStats, StepStats
from tokenmill.metrics.ceilings import Ceilings, utilization
from tokenmill.metrics.slo import SLO
from tokenmill.metrics.step_cost import PlanFigures, step_rates

WINDOW_S = 10.0  # the step window of the rates
HISTORY_S = 300.0  # latency percentiles and throughput over the last minutes
SAMPLE_S = 0.25  # the step counters are sampled at most this often
GOODPUT_WINDOW_S = 60.0
COMPOSITION_STEPS = 120  # batch composition of the last steps
LATENCY_SAMPLES = 4096  # per latency kind


@dataclass(frozen=True)
class WindowRates:
    seconds: float
    steps: int
    busy: float  # fraction of the window the engine was stepping
    step_ms: float | None
    prefill_tokens_per_step: float | None
    decode_tokens_per_step: float | None
    bandwidth_gbps: float | None
    gflops: float | None


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list (not empty)."""
    return sorted_values[min(len(sorted_values) - 1, max(0, math.ceil(q / 100 * len(sorted_values)) - 1))]


class LiveStats:
    def __init__(self, model_name: str, start: float) -> None:
        self.model_name = model_name
        self.start = start
        self.ceilings: Ceilings | None = None
        self.slo: SLO | None = None
        self.plan: PlanFigures | None = None
        self.last = SchedulerStats()
        self.step: StepStats | None = None  # the latest step counters
        self._samples: deque[tuple[float, StepStats]] = deque()
        self._last_sample = -math.inf
        self._composition: deque[tuple[int, int]] = deque(maxlen=COMPOSITION_STEPS)
        self._latency = {k: deque[tuple[float, float]](maxlen=LATENCY_SAMPLES) for k in ("ttft", "tpot", "itl")}
        self._throughput: deque[list[float]] = deque(maxlen=int(HISTORY_S))  # [second, prompt, generation]
        self._slo_done: deque[tuple[float, bool]] = deque()
        self.slo_requests = self.slo_met = 0
        self.finished_requests = 0
        self.generation_tokens = self.prompt_tokens = 0

    def configure(self, ceilings: Ceilings | None, slo: SLO | None, plan: PlanFigures | None) -> None:
        self.ceilings, self.slo, self.plan = ceilings, slo, plan

    # ---- fed by EngineMetrics ------------------------------------------------------------
    def on_stats(self, stats: SchedulerStats, now: float) -> None:
        """Stats without step counters (an abort's, or with --disable-log-stats) keep the last counters."""
        step, before = stats.step, self.step
        self.last = stats
        if step is None:
            return
        self.step = step
        if before is None or step.steps != before.steps:
            self._composition.append((step.last_prefill_tokens, step.last_decode_tokens))
        if now - self._last_sample >= SAMPLE_S:
            self._last_sample = now
            self._samples.append((now, step))
            while len(self._samples) > 2 and self._samples[1][0] < now - WINDOW_S:
                self._samples.popleft()

    def on_latency(self, kind: str, seconds: float, now: float) -> None:
        self._latency[kind].append((now, seconds))

    def on_tokens(self, prompt: int, generation: int, now: float) -> None:
        self.prompt_tokens += prompt
        self.generation_tokens += generation
        second = float(int(now))
        if self._throughput and self._throughput[-1][0] == second:
            self._throughput[-1][1] += prompt
            self._throughput[-1][2] += generation
        else:
            self._throughput.append([second, float(prompt), float(generation)])

    def on_finished(self, ttft_s: float | None, tpot_s: float | None, now: float) -> None:
        self.finished_requests += 1
        if self.slo is None:
            return
        met = self.slo.met(ttft_s, tpot_s)
        self.slo_requests += 1
        self.slo_met += met
        self._slo_done.append((now, met))

    # ---- read on demand ------------------------------------------------------------------
    def window(self) -> WindowRates | None:
        if not self._samples or self.step is None:
            return None
        t0, first = self._samples[0]
        now_t, last = self._samples[-1][0], self.step
        steps, busy = last.steps - first.steps, last.busy_s - first.busy_s
        span = max(now_t - t0, SAMPLE_S)
        rates = step_rates(first, last)
        if rates is None:
            return WindowRates(span, 0, 0.0, None, None, None, None, None)
        return WindowRates(span, steps, min(1.0, busy / span), busy / steps * 1e3,
                           (last.prefill_tokens - first.prefill_tokens) / steps,
                           (last.decode_tokens - first.decode_tokens) / steps, rates[0], rates[1])

    def utilizations(self, w: WindowRates | None) -> dict[str, Any]:
        """MBU and MFU of the window against the ceilings (each None without a ceiling or a rate)."""
        c = self.ceilings
        out: dict[str, Any] = {"mbu": None, "mfu": None, "bandwidth_ceiling_GBps": None, "flops_ceiling_gflops": None,
                               "bandwidth_ceiling_raised": False, "flops_ceiling_raised": False}
        if c is None:
            return out
        out["bandwidth_ceiling_GBps"], out["flops_ceiling_gflops"] = c.bandwidth_gbps, c.gflops
        if w is not None and w.bandwidth_gbps is not None and c.bandwidth_gbps:
            u = utilization(w.bandwidth_gbps, c.bandwidth_gbps)
            out.update(mbu=u.ratio, bandwidth_ceiling_GBps=u.ceiling, bandwidth_ceiling_raised=u.raised)
        if w is not None and w.gflops is not None and c.gflops:
            u = utilization(w.gflops, c.gflops)
            out.update(mfu=u.ratio, flops_ceiling_gflops=u.ceiling, flops_ceiling_raised=u.raised)
        return out

    def goodput(self, now: float) -> dict[str, Any] | None:
        if self.slo is None:
            return None
        while self._slo_done and self._slo_done[0][0] < now - GOODPUT_WINDOW_S:
            self._slo_done.popleft()
        span = max(1e-9, min(GOODPUT_WINDOW_S, now - self.start))
        met = sum(m for _, m in self._slo_done)
        n = len(self._slo_done)
        return {"slo": self.slo.describe(), "goodput_rps": met / span, "attainment": met / n if n else None,
                "window_s": span, "requests": self.slo_requests, "met": self.slo_met}

    def percentiles(self, now: float) -> dict[str, dict[str, float | int | None]]:
        out: dict[str, dict[str, float | int | None]] = {}
        for kind, samples in self._latency.items():
            values = sorted(v for t, v in samples if t >= now - HISTORY_S)
            out[kind] = {"n": len(values), **{f"p{q}": (percentile(values, q) * 1e3 if values else None)
                                              for q in (50, 90, 99)}}
        return out

    def kv_blocks(self) -> dict[str, int]:
        s = self.last
        return {"total": s.num_total_blocks, "used": s.num_total_blocks - s.num_free_blocks,
                "cached": s.num_cached_free_blocks, "free": s.num_free_blocks - s.num_cached_free_blocks}

    def kv_tiers(self) -> dict[str, dict[str, int]]:
        """The second KV tier's occupancy, per tier that is on: prefix blocks held (and, in memory, blocks
        reserved for swapped requests), bytes held and allowed, prompt tokens loaded from it."""
        s = self.last
        tiers: dict[str, dict[str, int]] = {}
        if s.kv_offload_memory_capacity_bytes:
            tiers["memory"] = {"cached_blocks": s.kv_offload_memory_blocks,
                               "swap_blocks": s.kv_offload_memory_swap_blocks,
                               "used_bytes": s.kv_offload_memory_used_bytes,
                               "capacity_bytes": s.kv_offload_memory_capacity_bytes,
                               "hit_tokens": s.kv_offload_memory_hits}
        if s.kv_offload_disk_capacity_bytes:
            tiers["disk"] = {"cached_blocks": s.kv_offload_disk_blocks, "swap_blocks": 0,
                             "used_bytes": s.kv_offload_disk_used_bytes,
                             "capacity_bytes": s.kv_offload_disk_capacity_bytes, "hit_tokens": s.kv_offload_disk_hits}
        return tiers

    def snapshot(self, now: float) -> dict[str, Any]:
        """Everything the dashboard shows, as one JSON-able dict."""
        s, w = self.last, self.window()
        c = self.ceilings
        return {
            "time": now, "model": self.model_name, "running": s.num_running, "waiting": s.num_waiting,
            "kv_blocks": self.kv_blocks(), "kv_cache_usage": s.kv_cache_usage, "kv_tiers": self.kv_tiers(),
            "prefix_cache_hit_rate": s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else None,
            "num_preemptions": s.num_preemptions, "steps": s.num_steps,
            "finished_requests": self.finished_requests, "generation_tokens": self.generation_tokens,
            "prompt_tokens": self.prompt_tokens,
            "window": None if w is None else w.__dict__, **self.utilizations(w),
            "bandwidth_source": None if c is None else c.bandwidth_source,
            "flops_source": None if c is None else c.flops_source,
            "latency_ms": self.percentiles(now),
            "throughput": [[t, p, g] for t, p, g in self._throughput if t >= now - HISTORY_S],
            "composition": list(self._composition),
            "goodput": self.goodput(now),
            "plan": None if self.plan is None else self.plan.__dict__,
            "stats_enabled": self.step is not None,
        }

    # ---- Prometheus ----------------------------------------------------------------------
    def _tier_gauges(self) -> Iterator[Metric]:
        tiers = self.kv_tiers()
        if not tiers:
            return
        labels = ["model_name", "tier"]
        blocks = GaugeMetricFamily("tokenmill:kv_offload_blocks", "Blocks held in the second KV tier, by tier and "
                                   "state: cached (prefix blocks, found by their hash), swap (reserved for "
                                   "requests preempted with --preemption-mode swap).", labels=[*labels, "state"])
        used = GaugeMetricFamily("tokenmill:kv_offload_used_bytes", "Bytes the second KV tier holds, by tier "
                                 "(memory: swap reservations included; disk: its files).", labels=labels)
        cap = GaugeMetricFamily("tokenmill:kv_offload_capacity_bytes", "Bytes the second KV tier may hold, by tier "
                                "(--kv-offload-memory, --kv-offload-disk-size).", labels=labels)
        for tier, t in tiers.items():
            blocks.add_metric([self.model_name, tier, "cached"], t["cached_blocks"])
            if tier == "memory":
                blocks.add_metric([self.model_name, tier, "swap"], t["swap_blocks"])
            used.add_metric([self.model_name, tier], t["used_bytes"])
            cap.add_metric([self.model_name, tier], t["capacity_bytes"])
        yield from (blocks, used, cap)

    def describe(self) -> list[Metric]:
        return []  # names are checked against the registry's own metrics by prometheus_client otherwise

    def collect(self) -> Iterator[Metric]:
        lab, m = ["model_name"], [self.model_name]

        def gauge(name: str, doc: str, value: float | None) -> Iterator[Metric]:
            if value is not None:
                g = GaugeMetricFamily(f"tokenmill:{name}", doc, labels=lab)
                g.add_metric(m, value)
                yield g

        def counter(name: str, doc: str, value: float) -> Metric:
            c = CounterMetricFamily(f"tokenmill:{name}", doc, labels=lab)
            c.add_metric(m, value)
            return c

        kv = GaugeMetricFamily("tokenmill:kv_cache_blocks", "KV-cache blocks by state: used (held by requests), "
                               "cached (free, holding prefix-cached KV), free (blank).", labels=["model_name", "state"])
        for state, n in self.kv_blocks().items():
            if state != "total":
                kv.add_metric([self.model_name, state], n)
        yield kv
        yield from self._tier_gauges()
        step = self.step
        if step is not None:
            yield counter("step_busy_seconds", "Wall time of engine steps (busy time).", step.busy_s)
            yield counter("step_prefill_tokens", "Prompt tokens computed by the steps.", step.prefill_tokens)
            yield counter("step_decode_tokens", "Output tokens computed by the steps (drafts included).",
                          step.decode_tokens)
            yield counter("step_bytes", "Bytes the steps read (weights and KV, tokenmill.model_math).", step.bytes)
            yield counter("step_flops", "FLOPs the steps did (tokenmill.model_math).", step.flops)
        w = self.window()
        u = self.utilizations(w)
        if w is not None:
            yield from gauge("step_time_seconds", f"Mean step time over the last {WINDOW_S:g} s.",
                             None if w.step_ms is None else w.step_ms / 1e3)
            yield from gauge("step_prefill_tokens_per_step", "Mean prompt tokens per step (window).",
                             w.prefill_tokens_per_step)
            yield from gauge("step_decode_tokens_per_step", "Mean output tokens per step (window).",
                             w.decode_tokens_per_step)
            yield from gauge("engine_busy_ratio", "Fraction of the window the engine was stepping.", w.busy)
            yield from gauge("memory_bandwidth_bytes_per_second", "Bytes read per second of step time (window).",
                             None if w.bandwidth_gbps is None else w.bandwidth_gbps * 1e9)
            yield from gauge("flops_per_second", "FLOPs per second of step time (window).",
                             None if w.gflops is None else w.gflops * 1e9)
        yield from gauge("model_bandwidth_utilization", "MBU: achieved bandwidth / the read ceiling (0-1).", u["mbu"])
        yield from gauge("model_flops_utilization", "MFU: achieved FLOP/s / the compute ceiling (0-1).", u["mfu"])
        if u["bandwidth_ceiling_GBps"] is not None:
            yield from gauge("roofline_memory_bandwidth_bytes_per_second", "The read ceiling MBU divides by.",
                             u["bandwidth_ceiling_GBps"] * 1e9)
        if u["flops_ceiling_gflops"] is not None:
            yield from gauge("roofline_flops_per_second", "The compute ceiling MFU divides by.",
                             u["flops_ceiling_gflops"] * 1e9)
        raised = GaugeMetricFamily("tokenmill:roofline_ceiling_raised", "1 where an achieved rate beat the "
                                   "cached ceiling, which is then raised to it (the ceiling was wrong).",
                                   labels=["model_name", "resource"])
        raised.add_metric([self.model_name, "bandwidth"], float(u["bandwidth_ceiling_raised"]))
        raised.add_metric([self.model_name, "flops"], float(u["flops_ceiling_raised"]))
        yield raised
        yield from self._collect_slo_and_plan(gauge, counter)

    def _collect_slo_and_plan(self, gauge: Any, counter: Any) -> Iterator[Metric]:
        g = self.goodput(self._samples[-1][0] if self._samples else self.start)
        if g is not None:
            yield from gauge("goodput_requests_per_second", f"Requests per second meeting the SLO ({g['slo']}), "
                             f"over the last {GOODPUT_WINDOW_S:g} s.", g["goodput_rps"])
            yield from gauge("slo_attainment_ratio", "Finished requests meeting the SLO / finished requests "
                             f"(last {GOODPUT_WINDOW_S:g} s).", g["attainment"])
            yield counter("slo_requests", "Finished requests judged against the SLO.", g["requests"])
            yield counter("slo_met_requests", "Finished requests that met the SLO.", g["met"])
        if self.plan is not None:
            yield from gauge("plan_decode_floor_seconds", f"tokenmill plan's decode floor per step, batch 1 at "
                             f"{self.plan.context} tokens of context.",
                             None if self.plan.decode_floor_ms is None else self.plan.decode_floor_ms / 1e3)
            yield from gauge("plan_kv_capacity_tokens", "Tokens of KV the pool holds (tokenmill plan).",
                             self.plan.capacity_tokens)
            yield from gauge("plan_capacity_requests", "Requests of max_model_len/2 tokens the pool holds at once.",
                             self.plan.capacity_requests)
