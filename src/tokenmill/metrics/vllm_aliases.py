"""vLLM's names for tokenmill's metrics, so that dashboards built for vLLM (its Grafana JSON, which
queries `vllm:*`) work against tokenmill: at scrape time each mapped tokenmill family is copied under
its vLLM name (same samples, same labels). The table is the documented mapping (docs/metrics.md)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric

# tokenmill family -> the vLLM families that mean the same (vLLM v1, and the older v0 name where it differs)
VLLM_NAMES: dict[str, tuple[str, ...]] = {
    "tokenmill:num_requests_running": ("vllm:num_requests_running",),
    "tokenmill:num_requests_waiting": ("vllm:num_requests_waiting",),
    "tokenmill:kv_cache_usage_perc": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "tokenmill:prompt_tokens": ("vllm:prompt_tokens",),
    "tokenmill:generation_tokens": ("vllm:generation_tokens",),
    "tokenmill:prefix_cache_queries": ("vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries"),
    "tokenmill:prefix_cache_hits": ("vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits"),
    "tokenmill:num_preemptions": ("vllm:num_preemptions",),
    "tokenmill:request_finished": ("vllm:request_success",),
    "tokenmill:time_to_first_token_seconds": ("vllm:time_to_first_token_seconds",),
    "tokenmill:inter_token_latency_seconds": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
    "tokenmill:request_time_per_output_token_seconds": ("vllm:request_time_per_output_token_seconds",),
    "tokenmill:e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds",),
    "tokenmill:request_queue_time_seconds": ("vllm:request_queue_time_seconds",),
    "tokenmill:spec_decode_num_drafts": ("vllm:spec_decode_num_drafts",),
    "tokenmill:spec_decode_num_draft_tokens": ("vllm:spec_decode_num_draft_tokens",),
    "tokenmill:spec_decode_num_accepted_tokens": ("vllm:spec_decode_num_accepted_tokens",),
    "tokenmill:spec_decode_num_accepted_tokens_per_pos": ("vllm:spec_decode_num_accepted_tokens_per_pos",),
}


def renamed(family: Metric, name: str) -> Metric:
    copy = Metric(name, family.documentation, family.type, family.unit)
    for s in family.samples:
        copy.add_sample(name + s.name[len(family.name):], s.labels, s.value, s.timestamp, s.exemplar)
    return copy


class VllmAliases:
    """A collector (in its own registry: it reads `source`'s) of the vLLM-named copies."""

    def __init__(self, source: CollectorRegistry) -> None:
        self.source = source

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        for family in self.source.collect():
            for name in VLLM_NAMES.get(family.name, ()):
                yield renamed(family, name)
