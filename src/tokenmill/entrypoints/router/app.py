"""`tokenmill router`: one OpenAI-compatible endpoint in front of several `tokenmill serve` (or any
OpenAI-compatible) replicas. It probes each replica's /health (the heartbeat), routes each request
by `pool.py`'s policy, proxies the body as it came and the answer as it comes (SSE streams pass
through chunk by chunk), and fails over: a request whose replica cannot be reached, or answers that
its engine is gone, is sent to another replica if nothing of the answer has reached the client yet;
a stream cut off mid-way ends with an SSE error event and `[DONE]`."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tokenmill.entrypoints.openai.errors import APIError, bad_request, install_error_handlers
from tokenmill.entrypoints.openai.middleware import GuardMiddleware
from tokenmill.entrypoints.router.affinity import prefix_hashes
from tokenmill.entrypoints.router.pool import Replica, ReplicaPool
from tokenmill.entrypoints.streaming import AbortingStreamingResponse

logger = logging.getLogger(__name__)

ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings")
# a replica answering one of these has lost its engine or is stopping: another replica may serve
_FAILOVER_CODES = ("engine_dead", "shutting_down")
_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "keep-alive", "content-encoding"}


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    workers: tuple[str, ...] = ()
    policy: str = "prefix"
    api_key: str | None = None
    worker_api_key: str | None = None
    health_interval: float = 1.0
    max_failures: int = 3
    max_attempts: int = 3
    balance_abs: int = 8
    balance_rel: float = 1.5
    prefix_chunks: int = 256
    request_timeout: float = 600.0
    max_request_bytes: int = 16 * 2**20


def routing_key(path: str, body: dict[str, Any]) -> str | list[int]:
    """What prefix affinity hashes: the (first) prompt, or the chat messages as role-tagged text."""
    if path == "/v1/chat/completions":  # any shape may come: the replica, not the router, rejects a bad body
        parts = []
        messages = body.get("messages")
        for m in messages if isinstance(messages, list) else []:
            if isinstance(m, dict):
                content = m.get("content")
                if isinstance(content, list):
                    content = "".join(t for p in content if isinstance(p, dict) and isinstance(t := p.get("text"), str))
                parts.append(f"<{m.get('role')}>{content if isinstance(content, str) else ''}")
        return "".join(parts)
    prompt = body.get("prompt" if path == "/v1/completions" else "input")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) and -2**63 <= t < 2**63
                                        for t in prompt):
        return prompt
    return ""


class _PoolCollector(Collector):
    def __init__(self, router: Router) -> None:
        self.router = router

    def collect(self) -> Iterator[Metric]:
        pool = self.router.pool
        healthy = GaugeMetricFamily("tokenmill_router_worker_healthy", "1 if the replica is in routing",
                                    labels=["worker"])
        running = GaugeMetricFamily("tokenmill_router_worker_requests_running",
                                    "requests the router has in flight on the replica", labels=["worker"])
        routed = CounterMetricFamily("tokenmill_router_worker_requests", "requests routed to the replica",
                                     labels=["worker"])
        for r in pool.replicas.values():
            healthy.add_metric([r.url], 1.0 if r.healthy else 0.0)
            running.add_metric([r.url], r.in_flight)
            routed.add_metric([r.url], r.routed)
        yield from (healthy, running, routed)
        yield CounterMetricFamily("tokenmill_router_prefix_routed", "requests sent to the replica holding "
                                  "their prompt's prefix", value=pool.prefix_routed)
        yield CounterMetricFamily("tokenmill_router_retries", "requests sent again to another replica after "
                                  "a failure", value=self.router.retries)
        yield CounterMetricFamily("tokenmill_router_failed", "requests that no replica could answer",
                                  value=self.router.failed)


class Router:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.pool = ReplicaPool(config.policy, config.balance_abs, config.balance_rel, config.max_failures)
        for url in config.workers:
            self.pool.add(url)
        self.retries = 0
        self.failed = 0
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(config.request_timeout, connect=5.0))
        self.registry = CollectorRegistry()
        self.registry.register(_PoolCollector(self))

    def headers_for(self, request: Request) -> dict[str, str]:
        headers = {"content-type": "application/json"}
        if self.config.worker_api_key:
            headers["authorization"] = f"Bearer {self.config.worker_api_key}"
        elif "authorization" in request.headers:
            headers["authorization"] = request.headers["authorization"]
        if "x-request-id" in request.headers:
            headers["x-request-id"] = request.headers["x-request-id"]
        return headers

    async def probe(self, replica: Replica, pool: ReplicaPool | None = None) -> None:
        """One /health probe of a replica of `pool` (the router's own by default)."""
        pool = pool or self.pool
        try:
            r = await self.client.get(f"{replica.url}/health", timeout=2.0)
            ok = r.status_code == 200
        except httpx.HTTPError:
            ok = False
        if not ok:
            pool.mark_failed(replica)
            return
        fresh = not replica.healthy
        pool.mark_ok(replica)
        if fresh or not replica.models:
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, TypeError):
                r = await self.client.get(f"{replica.url}/v1/models", timeout=5.0,
                                          headers=self._worker_auth())
                replica.models = [m["id"] for m in r.json()["data"]]

    def _worker_auth(self) -> dict[str, str]:
        key = self.config.worker_api_key
        return {"authorization": f"Bearer {key}"} if key else {}

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(r) for r in list(self.pool.replicas.values())))

    async def heartbeat(self) -> None:
        while True:
            await self.probe_all()
            await asyncio.sleep(self.config.health_interval)

    async def forward(self, request: Request, path: str) -> Response:
        raw = await request.body()
        body = parse_body(raw)
        hashes = prefix_hashes(routing_key(path, body), self.config.prefix_chunks)
        return await self.dispatch(path, raw, self.headers_for(request), hashes)

    async def dispatch(self, path: str, raw: bytes, headers: dict[str, str], hashes: list[int]) -> Response:
        """POST raw to a replica the policy chooses and relay its answer; another replica where one cannot be
        reached or has lost its engine, while nothing of the answer has reached the client."""
        tried: set[str] = set()
        for _attempt in range(self.config.max_attempts):
            replica = self.pool.choose(hashes, exclude=tried)
            if replica is None:
                break
            tried.add(replica.url)
            self.pool.started(replica, hashes)
            upstream = self.client.build_request("POST", f"{replica.url}{path}", content=raw, headers=headers)
            try:
                response = await self.client.send(upstream, stream=True)
            except httpx.TransportError as e:
                logger.warning("replica %s unreachable (%s); trying another", replica.url, e)
                self.pool.finished(replica)
                self.pool.mark_dead(replica)
                self.retries += 1
                continue
            if response.status_code == 503 and await self._engine_gone(response):
                self.pool.finished(replica)
                self.pool.mark_dead(replica)
                self.retries += 1
                continue
            return self._relay(replica, response)
        self.failed += 1
        raise APIError("no_workers", "no replica could serve the request" if tried else
                       "no healthy replica is registered with the router")

    async def _engine_gone(self, response: httpx.Response) -> bool:
        body = await response.aread()
        await response.aclose()
        with contextlib.suppress(ValueError, AttributeError, TypeError):
            return bool(json.loads(body)["error"]["code"] in _FAILOVER_CODES)
        return False

    def _relay(self, replica: Replica, response: httpx.Response) -> Response:
        headers = {k: v for k, v in response.headers.items() if k.lower() not in _HOP_HEADERS}
        headers["x-tokenmill-worker"] = replica.url
        sse = response.headers.get("content-type", "").startswith("text/event-stream")

        async def chunks() -> AsyncIterator[bytes]:
            try:
                async for chunk in response.aiter_raw():
                    yield chunk
            except httpx.TransportError as e:
                logger.warning("replica %s failed mid-answer (%s)", replica.url, e)
                self.pool.mark_dead(replica)
                if sse:
                    error = APIError("worker_failed", f"the replica serving this request failed mid-stream: {e}")
                    yield b"\n\ndata: " + error.body().model_dump_json().encode() + b"\n\ndata: [DONE]\n\n"
            finally:
                self.pool.finished(replica)
                await response.aclose()

        return AbortingStreamingResponse(chunks(), status_code=response.status_code, headers=headers,
                                 media_type=response.headers.get("content-type"))


def parse_body(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object, else a 400."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}", code="invalid_request") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", code="invalid_request")
    return body


def proxy_app(router: Router, title: str, routes: tuple[str, ...]) -> FastAPI:
    """What the router and the disaggregation proxy share: the replicas probed at start and every
    health_interval, `routes` forwarded by `router.forward`, /v1/models over the healthy replicas, and
    /metrics; each adds its /health and routes of its own."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await router.probe_all()
        beat = asyncio.create_task(router.heartbeat())
        try:
            yield
        finally:
            beat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beat
            await router.client.aclose()

    app = FastAPI(title=title, lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.router = router
    install_error_handlers(app)

    for path in routes:
        async def proxy(request: Request, _path: str = path) -> Response:
            return await router.forward(request, _path)
        app.add_api_route(path, proxy, methods=["POST"])

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        names = sorted({m for r in router.pool.healthy() for m in r.models})
        return JSONResponse({"object": "list", "data": [{"id": m, "object": "model", "owned_by": "tokenmill"}
                                                        for m in names]})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(router.registry), media_type="text/plain; version=0.0.4")

    return app


def build_app(config: RouterConfig) -> FastAPI:
    router = Router(config)
    app = proxy_app(router, "tokenmill router", ROUTES)

    @app.get("/health")
    async def health() -> JSONResponse:
        workers = [{"url": r.url, "healthy": r.healthy, "requests_running": r.in_flight}
                   for r in router.pool.replicas.values()]
        return JSONResponse({"workers": workers}, status_code=200 if router.pool.healthy() else 503)

    @app.get("/router/workers")
    async def list_workers() -> JSONResponse:
        return JSONResponse({"workers": [dataclasses.asdict(r) for r in router.pool.replicas.values()]})

    @app.post("/router/workers")
    async def register(request: Request) -> JSONResponse:
        """A replica registers (and, posting again, heartbeats): {"url": "http://host:port"}."""
        url = await _url_of(request)
        replica = router.pool.add(url)
        await router.probe(replica)
        return JSONResponse({"url": replica.url, "healthy": replica.healthy})

    @app.delete("/router/workers")
    async def deregister(request: Request) -> JSONResponse:
        url = await _url_of(request)
        router.pool.remove(url)
        return JSONResponse({"url": url, "removed": True})

    return GuardMiddleware(app, config.api_key, config.max_request_bytes)  # type: ignore[return-value]


async def _url_of(request: Request) -> str:
    try:
        url = (await request.json())["url"]
    except (ValueError, KeyError, TypeError):
        raise bad_request("the body must be {\"url\": \"http://host:port\"}", "url", "invalid_request") from None
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise bad_request("url must start with http:// or https://", "url")
    return url.rstrip("/")
