"""Summary figures of a `tokenmill bench serve` run, named as vLLM's `bench serve` names them:
throughputs over the whole run's duration, mean/median/std/p90/p99 of TTFT, TPOT, ITL and E2E
latency in ms over the successful requests (ITL pools every request's gaps), and goodput: the
requests per second that met every SLO given."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from tokenmill.bench.serve_client import RequestResult

SLO_KEYS = ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")
PERCENTILES = (90, 99)


def parse_slo(spec: str | None) -> dict[str, float]:
    """'ttft_ms=500,tpot_ms=50' (or vLLM's 'ttft:500 tpot:50') -> {'ttft_ms': 500.0, 'tpot_ms': 50.0}."""
    if not spec:
        return {}
    out = {}
    for item in spec.replace(",", " ").split():
        key, sep, value = item.replace(":", "=").partition("=")
        key = key if key.endswith("_ms") else f"{key}_ms"
        try:
            number = float(value)
        except ValueError:
            number = -1.0
        if not sep or key not in SLO_KEYS or number <= 0:
            raise ValueError(f"--slo {spec!r}: expected KEY=MS pairs with KEY in {', '.join(SLO_KEYS)}")
        out[key] = number
    return out


def meets_slo(r: RequestResult, slo: dict[str, float]) -> bool:
    if not r.ok:
        return False
    values = {"ttft_ms": r.e2e_s if r.ttft_s is None else r.ttft_s, "tpot_ms": r.tpot_s or 0.0,
              "e2el_ms": r.e2e_s, "itl_ms": max(r.itl_s, default=0.0)}
    return all(values[k] * 1e3 <= limit for k, limit in slo.items())


def _stats(name: str, values_s: list[float]) -> dict[str, float | None]:
    if not values_s:
        return {f"{k}_{name}_ms": None for k in ("mean", "median", "std", *(f"p{p}" for p in PERCENTILES))}
    ms = np.asarray(values_s) * 1e3
    out = {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
           f"std_{name}_ms": float(ms.std())}
    for p in PERCENTILES:
        out[f"p{p}_{name}_ms"] = float(np.percentile(ms, p))
    return {k: round(v, 3) for k, v in out.items()}


def summarize(results: list[RequestResult], duration_s: float, slo: dict[str, float]) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    input_tokens = sum(r.prompt_len or 0 for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    good = sum(meets_slo(r, slo) for r in ok) if slo else None
    duration = max(duration_s, 1e-9)
    out: dict[str, Any] = {
        "completed": len(ok), "failed": len(results) - len(ok), "duration": round(duration_s, 4),
        "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
        "request_throughput": round(len(ok) / duration, 4),
        "request_goodput": None if good is None else round(good / duration, 4), "good_requests": good,
        "output_throughput": round(output_tokens / duration, 2),
        "total_token_throughput": round((input_tokens + output_tokens) / duration, 2),
    }
    out.update(_stats("ttft", [r.ttft_s for r in ok if r.ttft_s is not None]))
    out.update(_stats("tpot", [t for r in ok if (t := r.tpot_s) is not None]))
    out.update(_stats("itl", [g for r in ok for g in r.itl_s]))
    out.update(_stats("e2el", [r.e2e_s for r in ok]))
    out["errors"] = dict(Counter(r.error for r in results if r.error is not None).most_common(10))
    return out


def turn_stats(per_chain: list[list[RequestResult]]) -> dict[str, Any]:
    """For multi-turn chains: TTFT of first turns and of returning ones (second turn on), whose prompts
    start with the conversation so far."""
    if all(len(chain) <= 1 for chain in per_chain):
        return {}
    first = [c[0].ttft_s for c in per_chain if c and c[0].ok and c[0].ttft_s is not None]
    later = [r.ttft_s for c in per_chain for r in c[1:] if r.ok and r.ttft_s is not None]
    out: dict[str, Any] = {"returning_requests": len(later)}
    out.update({k.replace("_ttft_", "_first_turn_ttft_"): v for k, v in _stats("ttft", first).items()})
    out.update({k.replace("_ttft_", "_returning_ttft_"): v for k, v in _stats("ttft", later).items()})
    return out


def render(summary: dict[str, Any]) -> str:
    s = summary
    lines = [
        f"{'successful requests':<32}{s['completed']}",
        f"{'failed requests':<32}{s['failed']}",
        f"{'duration (s)':<32}{s['duration']:.2f}",
        f"{'input / output tokens':<32}{s['total_input_tokens']} / {s['total_output_tokens']}",
        f"{'request throughput (req/s)':<32}{s['request_throughput']:.2f}",
    ]
    if s["request_goodput"] is not None:
        lines.append(f"{'request goodput (req/s)':<32}{s['request_goodput']:.2f}")
    lines += [f"{'output throughput (tok/s)':<32}{s['output_throughput']:.1f}",
              f"{'total throughput (tok/s)':<32}{s['total_token_throughput']:.1f}",
              f"{'(ms)':<8}{'mean':>10}{'median':>10}{'p90':>10}{'p99':>10}"]
    for name in ("ttft", "tpot", "itl", "e2el"):
        cells = [s[f"{k}_{name}_ms"] for k in ("mean", "median", "p90", "p99")]
        lines.append(f"{name.upper():<8}" + "".join("       -  " if c is None else f"{c:>10.1f}" for c in cells))
    if s.get("median_first_turn_ttft_ms") is not None and s.get("median_returning_ttft_ms") is not None:
        lines.append(f"{'TTFT median, first / returning':<32}{s['median_first_turn_ttft_ms']:.1f} / "
                     f"{s['median_returning_ttft_ms']:.1f} ms")
    if s.get("server_prefix_cache_hit_rate") is not None:
        lines.append(f"{'server prefix-cache hit rate':<32}{s['server_prefix_cache_hit_rate']:.3f}"
                     + (f" ({s['server_hit_rate_with_tiers']:.3f} with tier 2)"
                        if s.get("server_hit_rate_with_tiers") is not None else ""))
    for err, n in s["errors"].items():
        lines.append(f"error x{n}: {err}")
    return "\n".join(lines)
