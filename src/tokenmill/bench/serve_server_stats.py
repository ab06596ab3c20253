"""The servers' own prefix-cache counters around a `bench serve` run: each --server-metrics URL's
`/metrics` (default: the --base-url's) is read after the warm-up and after the run, and the counters'
differences, summed over the servers, give the prompt tokens looked up, those found in the prefix
cache, those loaded from a second KV tier (tokenmill's `kv_offload_hits`, per tier) and the hit rates,
and the requests preempted (and, with `--preemption-mode swap`, swapped out).
tokenmill's names are read first, vLLM's (`vllm:prefix_cache_*`) where those are absent; a server
whose /metrics cannot be read adds nothing, and with none read the figures are None."""

from __future__ import annotations

from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

QUERIES = ("tokenmill:prefix_cache_queries", "vllm:prefix_cache_queries")
HITS = ("tokenmill:prefix_cache_hits", "vllm:prefix_cache_hits")
PREEMPTIONS = ("tokenmill:num_preemptions", "vllm:num_preemptions")
TIER_HITS = "tokenmill:kv_offload_hits"
SWAPPED = "tokenmill:num_swapped"


def parse_counters(text: str) -> dict[str, float]:
    """'queries', 'hits' and 'tier_<name>' totals from one server's /metrics text."""
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if not s.name.endswith("_total"):
                continue
            base = s.name[:-len("_total")]
            if base == TIER_HITS:
                key = f"tier_{s.labels.get('tier', '')}"
            elif base == SWAPPED:
                if s.labels.get("direction") != "out":
                    continue
                key = "swapped"
            elif base in PREEMPTIONS:
                key = f"preemptions:{base}"
            elif base in QUERIES:
                key = f"queries:{base}"
            elif base in HITS:
                key = f"hits:{base}"
            else:
                continue
            found[key] = found.get(key, 0.0) + s.value
    out = {k: v for k, v in found.items() if k.startswith("tier_") or k == "swapped"}
    for kind, names in (("queries", QUERIES), ("hits", HITS), ("preemptions", PREEMPTIONS)):
        values = [found[f"{kind}:{n}"] for n in names if f"{kind}:{n}" in found]
        if values:
            out[kind] = values[0]  # tokenmill's own name where the server has both
    return out


async def scrape(client: httpx.AsyncClient, urls: list[str]) -> list[dict[str, float] | None]:
    out: list[dict[str, float] | None] = []
    for url in urls:
        try:
            resp = await client.get(url.rstrip("/") + "/metrics")
            out.append(parse_counters(resp.text) if resp.status_code == 200 else None)
        except (httpx.HTTPError, ValueError):
            out.append(None)
    return out


def summarize_counters(before: list[dict[str, float] | None], after: list[dict[str, float] | None]) -> dict[str, Any]:
    total: dict[str, float] = {}
    read = 0
    for b, a in zip(before, after, strict=True):
        if b is None or a is None or "queries" not in a:
            continue
        read += 1
        for key, value in a.items():
            total[key] = total.get(key, 0.0) + value - b.get(key, 0.0)
    if not read:
        return {"server_prefix_cache_hit_rate": None}
    queries, hits = total.get("queries", 0.0), total.get("hits", 0.0)
    tiers = {k[len("tier_"):]: int(v) for k, v in sorted(total.items()) if k.startswith("tier_")}
    return {
        "server_metrics_read": read,
        "server_prefix_query_tokens": int(queries), "server_prefix_hit_tokens": int(hits),
        "server_prefix_cache_hit_rate": round(hits / queries, 4) if queries else None,
        "server_kv_offload_hit_tokens": tiers or None,
        "server_hit_rate_with_tiers": round((hits + sum(tiers.values())) / queries, 4) if queries and tiers else None,
        "server_preemptions": int(total["preemptions"]) if "preemptions" in total else None,
        "server_swapped_out": int(total["swapped"]) if "swapped" in total else None,
    }
