"""Prometheus metrics of the serving engine (names follow vLLM's, with a `tokenmill:` prefix).

Per-request timings are fed from the API process's view of the stream (RequestOutput deltas
and the core's first-scheduled times); gauges and cumulative counters come from the
SchedulerStats the core sends with every step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tokenmill.core.messages import SchedulerStats
from tokenmill.metrics.live import LiveStats
from tokenmill.metrics.tracing import RequestSpanTimes, RequestTracer
from tokenmill.metrics.vllm_aliases import VllmAliases
from tokenmill.outputs import RequestOutput

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                    60.0, 120.0, 240.0, 480.0, 960.0)


@dataclass
class _RequestTimes:
    arrival: float
    num_prompt_tokens: int
    first_token: float | None = None
    scheduled: float | None = None
    detokenize_s: float = 0.0  # the API process's handling of its outputs (traced requests only)
    # per completion index: (first token time, last token time, number of tokens)
    seqs: dict[int, list[float]] = field(default_factory=dict)


class EngineMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.model_name = model_name
        # the step window, SLO and dashboard figures, computed when scraped (metrics/live.py)
        self.live = LiveStats(model_name, time.time())
        self.registry.register(self.live)
        self._aliases = CollectorRegistry()  # vllm: names of the same samples, for vLLM's Grafana dashboards
        self._aliases.register(VllmAliases(self.registry))
        reg, lab = self.registry, ["model_name"]

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"tokenmill:{name}", doc, lab, registry=reg, buckets=buckets)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between successive output tokens.",
                        _LATENCY_BUCKETS)
        self.tpot = hist("request_time_per_output_token_seconds",
                         "Mean time per output token after the first, per sequence.", _LATENCY_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "End-to-end request latency.", _REQUEST_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "Time from arrival to first scheduling.",
                          _REQUEST_BUCKETS)
        self.running = Gauge("tokenmill:num_requests_running", "Sequences running in the engine.", lab,
                             registry=reg)
        self.waiting = Gauge("tokenmill:num_requests_waiting", "Sequences waiting to be scheduled.", lab,
                             registry=reg)
        self.kv_usage = Gauge("tokenmill:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).",
                              lab, registry=reg)
        self.kv_free = Gauge("tokenmill:kv_cache_free_blocks", "Free KV-cache blocks (prefix-cached "
                             "blocks not in use count as free).", lab, registry=reg)
        self.kv_total = Gauge("tokenmill:kv_cache_total_blocks", "KV-cache blocks in the pool.", lab,
                              registry=reg)
        self.prompt_tokens = Counter("tokenmill:prompt_tokens", "Prompt tokens prefilled.", lab, registry=reg)
        self.generation_tokens = Counter("tokenmill:generation_tokens", "Output tokens generated.", lab,
                                         registry=reg)
        self.prefix_queries = Counter("tokenmill:prefix_cache_queries", "Prompt tokens looked up in the "
                                      "prefix cache.", lab, registry=reg)
        self.prefix_hits = Counter("tokenmill:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                                   lab, registry=reg)
        self.preemptions = Counter("tokenmill:num_preemptions", "Sequences preempted.", lab, registry=reg)
        self.finished = Counter("tokenmill:request_finished", "Requests finished, by outcome.",
                                ["model_name", "finished_reason"], registry=reg)
        self.spec_drafts = Counter("tokenmill:spec_decode_num_drafts", "Verifications of a request's draft "
                                   "tokens.", lab, registry=reg)
        self.spec_draft_tokens = Counter("tokenmill:spec_decode_num_draft_tokens", "Draft tokens verified.", lab,
                                         registry=reg)
        self.spec_accepted = Counter("tokenmill:spec_decode_num_accepted_tokens", "Draft tokens accepted.", lab,
                                     registry=reg)
        self.spec_accepted_per_pos = Counter("tokenmill:spec_decode_num_accepted_tokens_per_pos",
                                             "Draft tokens accepted, by draft position.",
                                             ["model_name", "position"], registry=reg)
        self.spec_acceptance = Gauge("tokenmill:spec_decode_acceptance_rate", "Accepted / verified draft "
                                     "tokens since start-up.", lab, registry=reg)
        self.spec_acceptance_per_pos = Gauge("tokenmill:spec_decode_acceptance_rate_per_pos", "Accepted drafts "
                                             "at a position / verifications, since start-up.",
                                             ["model_name", "position"], registry=reg)
        self.spec_mean_length = Gauge("tokenmill:spec_decode_mean_accepted_length", "Tokens a verification "
                                      "takes on average (accepted drafts and one more), since start-up.", lab,
                                      registry=reg)
        self.tier_hits = Counter("tokenmill:kv_offload_hits", "Prompt tokens whose KV was loaded from the second "
                                 "KV tier instead of computed, by tier.", ["model_name", "tier"], registry=reg)
        self.tier_bytes = Counter("tokenmill:kv_offload_bytes", "Bytes of KV moved between the KV cache and its "
                                  "second tier (out: evicted prefix blocks, swapped requests; in: loaded).",
                                  ["model_name", "direction"], registry=reg)
        self.tier_corrupt = Counter("tokenmill:kv_offload_corrupt_blocks", "Disk-tier blocks that failed their "
                                    "checks (recomputed, deleted).", lab, registry=reg)
        self.swaps = Counter("tokenmill:num_swapped", "Preempted requests swapped out of the KV cache and back "
                             "in (--preemption-mode swap).", ["model_name", "direction"], registry=reg)
        self.structured = Counter("tokenmill:structured_output_requests", "Requests constrained by structured "
                                  "output (response_format, tools, structured_outputs) whose grammar was ready, by "
                                  "kind (json, json_object, regex, choice, grammar).",
                                  ["model_name", "kind"], registry=reg)
        self.structured_failed = Counter("tokenmill:structured_output_failed_requests", "Constrained requests "
                                         "whose grammar could not be built (ended with the error).", lab, registry=reg)
        self.grammar_compiles = Counter("tokenmill:grammar_compilations", "Grammars compiled (requests whose "
                                        "grammar was cached take none).", lab, registry=reg)
        self.grammar_seconds = Counter("tokenmill:grammar_compile_seconds", "Seconds spent compiling grammars "
                                       "(in the compile thread, off the step loop).", lab, registry=reg)
        self.transfer_bytes = Counter("tokenmill:kv_transfer_bytes", "KV bytes sent to consumers (a KV producer) "
                                      "and received from producers (a KV consumer), disaggregated prefill/decode.",
                                      ["model_name", "direction"], registry=reg)
        self.transfer_seconds = Counter("tokenmill:kv_transfer_seconds", "A KV consumer's seconds from asking for "
                                        "a prompt's blocks to the last one in, summed over transfers.", lab,
                                        registry=reg)
        self.transfer_failures = Counter("tokenmill:kv_transfer_failures", "KV pulls that failed (the consumer "
                                         "computed the prompt itself).", lab, registry=reg)
        self._requests: dict[str, _RequestTimes] = {}
        self._last_stats = SchedulerStats()
        self._structured_seen: dict[str, float] = {}  # the grammar backend's counts already counted
        self.tracer: RequestTracer | None = None  # set by --otlp-traces-endpoint

    def render(self) -> bytes:
        return generate_latest(self.registry) + generate_latest(self._aliases)

    def request_added(self, request_id: str, arrival: float, num_prompt_tokens: int) -> None:
        self._requests[request_id] = _RequestTimes(arrival, num_prompt_tokens)

    def request_scheduled(self, request_id: str, when: float) -> None:
        times = self._requests.get(request_id)
        if times is not None and times.first_token is None:
            self.queue.labels(self.model_name).observe(max(0.0, when - times.arrival))
            times.scheduled = when if times.scheduled is None else times.scheduled

    def output(self, out: RequestOutput, now: float) -> None:
        """One DELTA RequestOutput reached the API process."""
        times = self._requests.get(out.request_id)
        if times is None:
            return
        new_tokens = 0
        for comp in out.outputs:
            n = len(comp.token_ids)
            if not n:
                continue
            new_tokens += n
            seq = times.seqs.get(comp.index)
            if seq is None:
                times.seqs[comp.index] = [now, now, n]
            else:
                self.itl.labels(self.model_name).observe(now - seq[1])
                self.live.on_latency("itl", now - seq[1], now)
                seq[1], seq[2] = now, seq[2] + n
        prompt_tokens = 0
        if new_tokens and times.first_token is None:
            times.first_token = now
            self.ttft.labels(self.model_name).observe(now - times.arrival)
            self.live.on_latency("ttft", now - times.arrival, now)
            self.prompt_tokens.labels(self.model_name).inc(times.num_prompt_tokens)
            prompt_tokens = times.num_prompt_tokens
        self.generation_tokens.labels(self.model_name).inc(new_tokens)
        self.live.on_tokens(prompt_tokens, new_tokens, now)
        if self.tracer is not None:
            times.detokenize_s += time.time() - now
        if out.finished:
            reasons = [c.finish_reason for c in out.outputs if c.finish_reason]
            self.request_finished(out.request_id, reasons[0] if reasons else "stop", now)

    def request_finished(self, request_id: str, reason: str, now: float) -> None:
        times = self._requests.pop(request_id, None)
        if times is None:
            return
        self.finished.labels(self.model_name, reason).inc()
        self.e2e.labels(self.model_name).observe(now - times.arrival)
        worst_tpot: float | None = None
        for first, last, n in times.seqs.values():
            if n > 1:
                tpot = (last - first) / (n - 1)
                self.tpot.labels(self.model_name).observe(tpot)
                self.live.on_latency("tpot", tpot, now)
                worst_tpot = tpot if worst_tpot is None else max(worst_tpot, tpot)
        ttft = None if times.first_token is None else times.first_token - times.arrival
        if reason != "abort":  # a request the client gave up on is not judged against the SLO
            self.live.on_finished(ttft, worst_tpot, now)
        if self.tracer is not None:
            last_token = max((seq[1] for seq in times.seqs.values()), default=None)
            self.tracer.request_done(RequestSpanTimes(
                request_id, times.arrival, times.scheduled, times.first_token, last_token, time.time(), now,
                times.detokenize_s, times.num_prompt_tokens, sum(int(seq[2]) for seq in times.seqs.values()), reason))

    def scheduler_stats(self, stats: SchedulerStats, now: float | None = None) -> None:
        m, last = self.model_name, self._last_stats
        self.live.on_stats(stats, time.time() if now is None else now)
        self.running.labels(m).set(stats.num_running)
        self.waiting.labels(m).set(stats.num_waiting)
        self.kv_usage.labels(m).set(stats.kv_cache_usage)
        self.kv_free.labels(m).set(stats.num_free_blocks)
        self.kv_total.labels(m).set(stats.num_total_blocks)
        self.prefix_queries.labels(m).inc(max(0, stats.prefix_cache_queries - last.prefix_cache_queries))
        self.prefix_hits.labels(m).inc(max(0, stats.prefix_cache_hits - last.prefix_cache_hits))
        self.preemptions.labels(m).inc(max(0, stats.num_preemptions - last.num_preemptions))
        if stats.spec_num_drafts:
            self._spec_stats(stats, last)
        if stats.kv_offload_bytes_offloaded or stats.kv_offload_bytes_loaded or stats.kv_offload_corrupt_blocks:
            self._tier_stats(stats, last)
        if stats.structured_requests or stats.structured_failed or stats.grammar_compiles:
            self._structured_stats(stats)
        if stats.kv_transfer_bytes_sent or stats.kv_transfer_bytes_received or stats.kv_transfer_failures:
            self.transfer_bytes.labels(m, "sent").inc(
                max(0, stats.kv_transfer_bytes_sent - last.kv_transfer_bytes_sent))
            self.transfer_bytes.labels(m, "received").inc(
                max(0, stats.kv_transfer_bytes_received - last.kv_transfer_bytes_received))
            self.transfer_seconds.labels(m).inc(max(0.0, stats.kv_transfer_seconds - last.kv_transfer_seconds))
            self.transfer_failures.labels(m).inc(max(0, stats.kv_transfer_failures - last.kv_transfer_failures))
        self._last_stats = stats

    def _tier_stats(self, stats: SchedulerStats, last: SchedulerStats) -> None:
        m = self.model_name
        for counter, label, now, before in (
            (self.tier_hits, "memory", stats.kv_offload_memory_hits, last.kv_offload_memory_hits),
            (self.tier_hits, "disk", stats.kv_offload_disk_hits, last.kv_offload_disk_hits),
            (self.tier_bytes, "out", stats.kv_offload_bytes_offloaded, last.kv_offload_bytes_offloaded),
            (self.tier_bytes, "in", stats.kv_offload_bytes_loaded, last.kv_offload_bytes_loaded),
            (self.swaps, "out", stats.num_swapped_out, last.num_swapped_out),
            (self.swaps, "in", stats.num_swapped_in, last.num_swapped_in),
        ):
            counter.labels(m, label).inc(max(0, now - before))
        self.tier_corrupt.labels(m).inc(max(0, stats.kv_offload_corrupt_blocks - last.kv_offload_corrupt_blocks))

    def _structured_stats(self, stats: SchedulerStats) -> None:
        """Each counter goes up by what the core's cumulative count passed since the highest seen (a stats
        message without the grammar backend's counts leaves them)."""
        m, seen = self.model_name, self._structured_seen
        counts: dict[str, float] = {f"kind:{k}": n for k, n in stats.structured_requests.items()}
        counts.update(failed=stats.structured_failed, compiles=stats.grammar_compiles,
                      seconds=stats.grammar_compile_seconds)
        for key, value in counts.items():
            step = value - seen.get(key, 0)
            if step <= 0:
                continue
            seen[key] = value
            if key.startswith("kind:"):
                self.structured.labels(m, key[len("kind:"):]).inc(step)
            else:
                {"failed": self.structured_failed, "compiles": self.grammar_compiles,
                 "seconds": self.grammar_seconds}[key].labels(m).inc(step)

    def _spec_stats(self, stats: SchedulerStats, last: SchedulerStats) -> None:
        m = self.model_name
        self.spec_drafts.labels(m).inc(max(0, stats.spec_num_drafts - last.spec_num_drafts))
        self.spec_draft_tokens.labels(m).inc(max(0, stats.spec_num_draft_tokens - last.spec_num_draft_tokens))
        self.spec_accepted.labels(m).inc(max(0, stats.spec_num_accepted_tokens - last.spec_num_accepted_tokens))
        before = last.spec_num_accepted_tokens_per_pos
        for pos, n in enumerate(stats.spec_num_accepted_tokens_per_pos):
            self.spec_accepted_per_pos.labels(m, str(pos)).inc(max(0, n - (before[pos] if pos < len(before) else 0)))
            self.spec_acceptance_per_pos.labels(m, str(pos)).set(n / stats.spec_num_drafts)
        if stats.spec_num_draft_tokens:
            self.spec_acceptance.labels(m).set(stats.spec_num_accepted_tokens / stats.spec_num_draft_tokens)
        self.spec_mean_length.labels(m).set(1 + stats.spec_num_accepted_tokens / stats.spec_num_drafts)
