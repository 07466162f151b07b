"""The router's ASGI application and the object that owns its resources.

`Router` owns everything long-lived (the pool's health task, the upstream
connections of the data plane, the httpx client of the control plane) and closes
it in `aclose`. `build_app` turns it into an ASGI app whose routes are an
allow-list: the OpenAI API paths are forwarded (straight to their endpoint,
see `DataPlaneFront`), the router answers `/health`, `/ready`, `/metrics` and
its own control plane `/admin/*` itself (Starlette routes), and every other
path — vLLM's dev endpoints included — is a 404 in the OpenAI error envelope.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import httpx
from prometheus_client import Counter
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from dpserve.config import RouterConfig, effective_policy, parse_target
from dpserve.router.asgi import ASGIApp, Receive, Scope, Send
from dpserve.router.errors import error_response
from dpserve.router.fleet.adapters import Adapters
from dpserve.router.fleet.discovery import Discovery
from dpserve.router.fleet.health import EngineScraper, HealthChecker
from dpserve.router.fleet.pool import Replica, ReplicaPool
from dpserve.router.forward.budget import BodyBudget
from dpserve.router.forward.proxy import ProxyEndpoint
from dpserve.router.heap import freeze_long_lived
from dpserve.router.http.admin import admin_routes
from dpserve.router.http.auth import Authenticate, auth_options, authenticate
from dpserve.router.kv.routing import KVRouting, PromptTokens
from dpserve.router.peers.link import PeerLink
from dpserve.router.peers.metrics import PeerCollector
from dpserve.router.routing.dispatch import Dispatcher
from dpserve.router.routing.policies import kv_aware_of, make_policy
from dpserve.router.telemetry.federate import EngineMetrics, engine_metrics_endpoint
from dpserve.router.telemetry.loop_lag import watch_loop
from dpserve.router.telemetry.metrics import CONTENT_TYPE, RouterMetrics
from dpserve.router.telemetry.tracing import Tracing
from dpserve.router.upstream.client import UpstreamClient, UpstreamPool

log = logging.getLogger("dpserve.router")

# (path, method) — the public surface forwarded to replicas. POST routes carry a JSON
# body; GET routes none (one sent anyway is refused, never forwarded).
FORWARDED_ROUTES = (
    ("/v1/completions", "POST"),
    ("/v1/chat/completions", "POST"),
    ("/v1/embeddings", "POST"),
    ("/tokenize", "POST"),
    ("/detokenize", "POST"),
    ("/v1/models", "GET"),
)


class Router:
    """The router's state and resources, complete once constructed; `start` runs its
    background work (discovery, health checks, engine scrapes), `aclose` ends it.

    What the router does not own comes in as arguments, so it depends on nothing above
    it: `own_pause` tells the health checks a replica is paused by this router's own
    deploy (not someone else's), `weight_version` what a newly discovered replica
    serves, `routes` are more Starlette routes for the app (`/admin/deploy`),
    `adapters` the adapter table deploys fill, `admit` what a replica must get
    before it turns ready (the adapters it lacks), and `upstream` the data plane's
    client to the replicas (default: `UpstreamPool`; tests and benchmarks answer
    from memory with their own).
    """

    def __init__(self, pool: ReplicaPool, config: RouterConfig, *,
                 metrics: RouterMetrics | None = None,
                 own_pause: Callable[[Replica], bool] | None = None,
                 weight_version: Callable[[], str | None] | None = None,
                 routes: Sequence[BaseRoute] = (),
                 adapters: Adapters | None = None,
                 admit: Callable[[Replica], Awaitable[str | None]] | None = None,
                 upstream: UpstreamClient | None = None,
                 open_tokenizer: Callable[[str], PromptTokens] | None = None) -> None:
        self.pool = pool
        self.config = config
        self.metrics = metrics if metrics is not None else RouterMetrics(pool)
        self.control = httpx.AsyncClient()
        """The control plane's client: health checks, scrapes, admin calls."""
        policy = effective_policy(config)
        self.kv = (KVRouting(pool, config, self.control, open_tokenizer)
                   if policy == "kv-aware" else None)
        """Routing on the engines' KV events (`dpserve.router.kv.routing`)."""
        self.policy = make_policy(
            policy, prefix_chars=config.prefix_chars, load_factor=config.load_factor,
            adapter_slots=config.max_loras if config.enable_lora and config.lora_affinity
            else None, kv_index=self.kv.index if self.kv is not None else None)
        kv_policy = kv_aware_of(self.policy)
        if self.kv is not None and kv_policy is not None:
            self.kv.register(self.metrics.registry, kv_policy.stats)
        self.peers = PeerLink(pool, config, kv_policy) if config.peers else None
        """The other routers in front of these replicas (`dpserve.router.peers`)."""
        if self.peers is not None:
            self.metrics.registry.register(PeerCollector(self.peers))
        self.dispatcher = Dispatcher(
            pool, self.policy, config,
            uncached=self.kv.index.uncached_tokens if self.kv is not None else None)
        self.adapters = adapters if adapters is not None else Adapters()
        """LoRA adapter versions served beside the base model (filled by deploys)."""
        self.bodies = BodyBudget(config.max_inflight_body_bytes)
        """Request bytes held in memory by all requests together."""
        # No connection cap: the policy and vLLM's scheduler bound concurrency;
        # a cap here would queue requests invisibly in the client.
        self.upstream: UpstreamClient = upstream if upstream is not None else UpstreamPool()
        """The data plane's connections to the replicas."""
        failures = self.metrics.health_check_failures
        self.health = HealthChecker(pool, config, self.control,
                                    on_failure=lambda r: failures.labels(r.id).inc(),
                                    own_pause=own_pause, admit=admit)
        self.discovery = (Discovery(pool, parse_target(config.discover),
                                    interval_s=config.discover_interval_s,
                                    weight_version=weight_version or (lambda: None))
                          if config.discover is not None else None)
        self.scraper = (EngineScraper(pool, config, self.control)
                        if "engine_load" in self.policy.needs else None)
        self.engine_metrics = EngineMetrics(pool, self.metrics, self.control,
                                            max_age_s=config.engine_metrics_cache_s)
        """What `/metrics/engines` answers (`dpserve.router.telemetry.federate`)."""
        self.routes = list(routes)
        self.lagging_workers: Callable[[], list[int]] = list
        """Data-plane workers still routing on a table from before the pool last became
        ready (set by the workers' leader): `/ready` waits for them."""
        endpoint = config.otlp_traces_endpoint
        self.tracing = (Tracing(endpoint, Counter(
            "dpserve_trace_export_failures_total",
            "Batches of spans the OTLP exporter could not deliver (tracing only)",
            registry=self.metrics.registry)) if endpoint is not None else None)
        """Request spans, when an OTLP endpoint is configured
        (`dpserve.router.telemetry.tracing`)."""
        self._tasks: list[asyncio.Task[None]] = []

    def refresh_gauges(self) -> None:
        """Gauges read at scrape time: breaker states and the admission queue's depth."""
        now = time.monotonic()
        for replica in self.pool:
            state = self.dispatcher.breaker(replica).state(now)
            self.metrics.set_breaker_state(replica.id, state.value)
        self.metrics.queue_depth.set(self.dispatcher.queue.waiting)

    def watch_loop(self) -> None:
        """Sample this process's event-loop lag into `/metrics` until `aclose`."""
        self._tasks.append(asyncio.create_task(watch_loop(self.metrics.loop_lag.observe),
                                               name="dpserve-loop-lag"))

    async def start(self) -> None:
        """Find the replicas, check them once (those already up, once admitted, serve
        the first request), then keep doing both in the background."""
        self.watch_loop()
        if self.discovery is not None:
            await self.discovery.refresh()
            self._tasks.append(asyncio.create_task(self.discovery.run(),
                                                   name="dpserve-discovery"))
        if self.config.policy == "auto":
            log.info("policy auto: %s", "kv-aware (the prompts' token ids by "
                     f"{self.config.tokenizer}, the engines' KV events)" if self.kv is not None
                     else "prefix-affinity (kv-aware needs the served model's tokenizer: "
                     "--tokenizer)")
        if self.kv is not None:  # before the first replica is admitted: none is missed
            await self.kv.start()
        if self.peers is not None:
            await self.peers.start()
        await self.health.check_all()
        await self.health.admitted()
        self._tasks.append(asyncio.create_task(self.health.run(), name="dpserve-health"))
        if self.scraper is not None:
            await self.scraper.scrape_all()
            self._tasks.append(asyncio.create_task(self.scraper.run(),
                                                   name="dpserve-engine-scrape"))
        freeze_long_lived()  # what start-up built lives as long as the router: see heap

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        if self.peers is not None:
            await self.peers.aclose()
        if self.kv is not None:
            await self.kv.aclose()
        await self.health.aclose()
        self.upstream.close()
        await self.control.aclose()
        if self.tracing is not None:  # flushes the last spans (bounded by its timeout)
            await asyncio.to_thread(self.tracing.close)


def build_app(router: Router) -> DataPlaneFront:
    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready(request: Request) -> Response:
        n = len(router.pool.ready())
        if n == 0:
            return error_response(503, "no replica is ready")
        if router.kv is not None and not router.kv.tokenizer_settled.is_set():
            return error_response(503, "the prompt tokenizer is loading (kv-aware)")
        if lagging := router.lagging_workers():
            return error_response(503, f"router worker(s) {lagging} have not yet applied "
                                  "the replica table")
        return JSONResponse({"status": "ready", "replicas_ready": n,
                             "replicas_total": len(router.pool)})

    async def metrics(request: Request) -> Response:
        router.refresh_gauges()
        return Response(await router.metrics.render_all(), media_type=CONTENT_TYPE)

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/metrics/engines", engine_metrics_endpoint(router.engine_metrics),
              methods=["GET"]),
        *admin_routes(router.pool, router.health, router.dispatcher.streams),
        *router.routes,
    ]
    forwarded = proxy_endpoints(router)
    routes += [Route(path, endpoint, methods=[method])
               for (path, method), endpoint in forwarded.items()]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await router.start()
        try:
            yield
        finally:
            await router.aclose()

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        message = {404: f"no route {request.url.path}",
                   405: f"method {request.method} is not allowed on {request.url.path}"}.get(
            exc.status_code, exc.detail)
        return error_response(exc.status_code, message,
                              headers=dict(exc.headers) if exc.headers else None)

    async def internal_error(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, "internal router error")

    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={HTTPException: http_error, Exception: internal_error},
    )
    config = router.config
    app.add_middleware(Authenticate, **auth_options(config))
    return build_data_plane(router, app, forwarded)


def proxy_endpoints(router: Router) -> dict[tuple[str, str], ProxyEndpoint]:
    """The forwarded routes' endpoints, by (path, method)."""
    return {(path, method): ProxyEndpoint(
        path, pool=router.pool, dispatcher=router.dispatcher, config=router.config,
        metrics=router.metrics, upstream=router.upstream, bodies=router.bodies,
        keys=router.policy.needs, method=method, adapters=router.adapters,
        tracing=router.tracing, tokenize=router.kv.tokenize if router.kv is not None else None,
    ) for path, method in FORWARDED_ROUTES}


def build_data_plane(router: Router, rest: ASGIApp,
                     forwarded: dict[tuple[str, str], ProxyEndpoint] | None = None
                     ) -> DataPlaneFront:
    """The router's entry: forwarded routes straight to their endpoints, the `rest`
    (every other request, and the lifespan) to `rest`."""
    auth = authenticate(None, router.config)
    return DataPlaneFront(rest, forwarded if forwarded is not None
                          else proxy_endpoints(router), auth)


class DataPlaneFront:
    """ASGI entry: a forwarded route whose caller may use it goes straight to its
    endpoint; everything else (probes, admin, refusals, 404/405) goes through Starlette.

    Starlette's middleware stack and route matching are per-request costs the data
    plane does not need: `ProxyEndpoint` answers its own errors in the OpenAI envelope.
    """

    def __init__(self, app: ASGIApp, forwarded: dict[tuple[str, str], ProxyEndpoint],
                 auth: Authenticate) -> None:
        self.app = app
        self._forwarded = forwarded
        self._auth = auth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            endpoint = self._forwarded.get((scope["path"], scope["method"]))
            if endpoint is not None and self._auth.refusal(scope) is None:
                await endpoint(scope, receive, send)
                return
        await self.app(scope, receive, send)
