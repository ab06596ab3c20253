"""`tokenmill disagg-proxy`: one OpenAI-compatible endpoint in front of prefill (KV producer) and decode
(KV consumer) instances of `tokenmill serve --kv-transfer-config` (vLLM's toy proxy's protocol).

Each completion or chat request goes first to the prefill instance with the fewest requests in flight, as
a copy with `kv_transfer_params: {"do_remote_decode": true}`, `max_tokens` 1 and `stream` false: it computes
the prompt and the first token and keeps the prompt's KV blocks; its answer's `kv_transfer_params` say where
and under which id. Then the original request, with those `kv_transfer_params`, goes to the decode instance
with the fewest in flight, which pulls the blocks and decodes; its answer (an SSE stream or JSON) is relayed
as it comes, by the router's own relay (router/app.py: health probes, failover to another decode instance
while nothing has reached the client, a stream cut mid-way ends with an error event).

A request that cannot be split (several prompts, n > 1, echo, prompt logprobs, beam search, a grammar
constraint) goes straight to a decode instance, which computes it whole. So does one whose prefill fails
(no prefill instance healthy, a refused connection, an error answer): the decode instance then computes the
prompt itself, so a dead prefill instance costs time, never the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
from collections.abc import Iterator
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tokenmill.entrypoints.openai.middleware import GuardMiddleware
from tokenmill.entrypoints.router.app import Router, RouterConfig, parse_body, proxy_app
from tokenmill.entrypoints.router.pool import ReplicaPool

logger = logging.getLogger(__name__)

ROUTES = ("/v1/completions", "/v1/chat/completions")
_CONSTRAINTS = ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")


@dataclasses.dataclass(frozen=True)
class DisaggConfig(RouterConfig):
    """The router's settings over the decode instances (`workers`, fewest requests in flight first), and
    the prefill instances."""

    prefill: tuple[str, ...] = ()
    policy: str = "least_load"

    @property
    def decode(self) -> tuple[str, ...]:
        return self.workers


def splittable(path: str, body: dict[str, Any]) -> bool:
    """Whether a request can be prefilled on one instance and decoded on another."""
    if path not in ROUTES or "kv_transfer_params" in body:
        return False
    if body.get("n", 1) != 1 or body.get("echo") or body.get("prompt_logprobs") is not None \
            or body.get("use_beam_search") or any(body.get(k) is not None for k in _CONSTRAINTS):
        return False
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
        return False
    if body.get("tool_choice") not in (None, "auto", "none"):
        return False
    if path == "/v1/completions":
        prompt = body.get("prompt")
        return isinstance(prompt, str) or (isinstance(prompt, list) and bool(prompt) and (
            len(prompt) == 1 or all(isinstance(t, int) for t in prompt)))
    return True


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill instance's copy: compute the prompt and one token, keep the blocks, answer once."""
    out = {k: v for k, v in body.items() if k != "stream_options"}
    out.update(kv_transfer_params={"do_remote_decode": True}, stream=False, max_tokens=1)
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    if isinstance(out.get("min_tokens"), int) and out["min_tokens"] > 1:
        out["min_tokens"] = 1
    return out


class _PrefillCollector(Collector):
    def __init__(self, proxy: DisaggProxy) -> None:
        self.proxy = proxy

    def collect(self) -> Iterator[Metric]:
        healthy = GaugeMetricFamily("tokenmill_disagg_prefill_healthy", "1 if the prefill instance is in routing",
                                    labels=["worker"])
        running = GaugeMetricFamily("tokenmill_disagg_prefill_requests_running",
                                    "prefill requests the proxy has in flight on the instance", labels=["worker"])
        for r in self.proxy.prefill.replicas.values():
            healthy.add_metric([r.url], 1.0 if r.healthy else 0.0)
            running.add_metric([r.url], r.in_flight)
        yield from (healthy, running)
        yield CounterMetricFamily("tokenmill_disagg_prefilled", "requests prefilled on a prefill instance",
                                  value=self.proxy.prefilled)
        yield CounterMetricFamily("tokenmill_disagg_prefill_fallbacks", "splittable requests whose prefill failed "
                                  "(the decode instance computed the prompt)", value=self.proxy.fallbacks)


class DisaggProxy(Router):
    """The router over the decode instances (least in flight), plus the prefill instances."""

    def __init__(self, config: DisaggConfig) -> None:
        super().__init__(config)
        self.prefill = ReplicaPool("least_load", max_failures=config.max_failures)
        for url in config.prefill:
            self.prefill.add(url)
        self.prefilled = 0
        self.fallbacks = 0
        self.registry.register(_PrefillCollector(self))

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(r) for r in list(self.pool.replicas.values())),
                             *(self.probe(r, self.prefill) for r in list(self.prefill.replicas.values())))

    async def forward(self, request: Request, path: str) -> Response:
        raw = await request.body()
        body = parse_body(raw)
        headers = self.headers_for(request)
        prefilled_on = None
        if splittable(path, body):
            answer = await self._prefill(path, body, headers)
            if answer is not None:
                prefilled_on, params = answer
                raw = json.dumps({**body, "kv_transfer_params": params}).encode()
        response = await self.dispatch(path, raw, headers, [])
        if prefilled_on is not None:
            response.headers["x-tokenmill-prefill"] = prefilled_on
        return response

    async def _prefill(self, path: str, body: dict[str, Any], headers: dict[str, str]
                       ) -> tuple[str, dict[str, Any]] | None:
        """(the prefill instance, its kv_transfer_params), or None: the decode instance computes the prompt."""
        content = json.dumps(prefill_body(body)).encode()
        tried: set[str] = set()
        for _attempt in range(self.config.max_attempts):
            replica = self.prefill.choose((), exclude=tried)
            if replica is None:
                break
            tried.add(replica.url)
            self.prefill.started(replica, ())
            try:
                r = await self.client.post(f"{replica.url}{path}", content=content, headers=headers)
            except httpx.TransportError as e:
                logger.warning("prefill instance %s unreachable (%s)", replica.url, e)
                self.prefill.mark_dead(replica)
                continue
            finally:
                self.prefill.finished(replica)
            params = None
            with contextlib.suppress(ValueError, AttributeError):
                params = r.json().get("kv_transfer_params") if r.status_code == 200 else None
            if isinstance(params, dict):
                self.prefilled += 1
                return replica.url, params
            logger.warning("prefill instance %s answered %d without kv_transfer_params", replica.url, r.status_code)
            break  # its answer (a 4xx the decode instance will give too, or its engine's error): decode computes it
        self.fallbacks += 1
        return None


def build_disagg_app(config: DisaggConfig) -> FastAPI:
    if not config.decode:
        raise ValueError("give at least one --decode URL")
    proxy = DisaggProxy(config)
    app = proxy_app(proxy, "tokenmill disagg-proxy", ROUTES)

    @app.get("/health")
    async def health() -> JSONResponse:
        def listing(pool: ReplicaPool) -> list[dict[str, Any]]:
            return [{"url": r.url, "healthy": r.healthy, "requests_running": r.in_flight}
                    for r in pool.replicas.values()]
        # decode instances serve every request (they compute the prompt when no prefill instance can)
        return JSONResponse({"prefill": listing(proxy.prefill), "decode": listing(proxy.pool)},
                            status_code=200 if proxy.pool.healthy() else 503)

    return GuardMiddleware(app, config.api_key, config.max_request_bytes)  # type: ignore[return-value]
