"""Active health checks with hysteresis.

Every `health_interval_s` each replica's `GET /health` is called. A ready
replica leaves rotation after `unhealthy_threshold` consecutive failures; a
starting or down one enters it after `healthy_threshold` consecutive
successes, at which point its served model names are read from `/v1/models`
and the `admit` step runs (the engine's warm-up, the adapters it lacks: see
`dpserve.rollout.admit`), in a task of its own: a slow one holds neither the
other replicas' checks nor the next round.
Replicas being drained or reloaded belong to the admin path and are left alone.

A failed check counts (`on_failure`, the `dpserve_health_check_failures_total`
counter) only for a replica that has been ready since it last started: while an
engine loads, its `/health` refuses or answers 503 on every check for a minute,
which is start-up, not failure. A replica back in rotation, or whose check passes
while ready, has no `last_error` any more: the admin API shows current problems.

Passive signals (a refused connection in the proxy, a process exit seen by the
supervisor) take a replica out at once through `ReplicaPool.mark_down`; this
loop is what brings it back.

With `route_around_paused`, a healthy replica is also asked `GET /is_paused`
(vLLM dev mode). Several routers share the replicas on Kubernetes, and a
deploy run by one of them pauses a replica the others still route to; a paused
replica is therefore taken out at once (a deliberate state, not a flaky probe)
and comes back through the usual streak of good checks once resumed. Pauses of
this router's own deploy (`own_pause`) are left alone: its rollout manages
those replicas. An engine without the dev endpoint (404) counts as not paused.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import httpx

from dpserve.config import RouterConfig
from dpserve.router.fleet.engine_metrics import parse_engine_metrics
from dpserve.router.fleet.hysteresis import CHECKED, next_state
from dpserve.router.fleet.pool import Replica, ReplicaPool, ReplicaState

log = logging.getLogger("dpserve.health")

PAUSED = "paused (a deploy is hot-loading it)"


class HealthChecker:
    def __init__(self, pool: ReplicaPool, config: RouterConfig, client: httpx.AsyncClient,
                 *, on_failure: Callable[[Replica], None] | None = None,
                 own_pause: Callable[[Replica], bool] | None = None,
                 admit: Callable[[Replica], Awaitable[str | None]] | None = None) -> None:
        """`admit`: last step before a replica turns ready, after its models were read
        (loading the adapters it lacks); a reason not to admit it yet, or None."""
        self._pool = pool
        self._config = config
        self._client = client
        self._on_failure = on_failure
        self._own_pause = own_pause
        self._admit = admit
        self._admitting: dict[str, asyncio.Task[None]] = {}
        """Admissions under way, by replica id: they run beside the checks, since an
        admission may take seconds (the engine's warm-up, loading adapters)."""

    async def run(self) -> None:
        """Check forever; cancel the task to stop."""
        while True:
            await self.check_all()
            await asyncio.sleep(self._config.health_interval_s)

    async def check_all(self) -> None:
        replicas = [r for r in self._pool if r.state in CHECKED]
        results = await asyncio.gather(*(self._probe(r) for r in replicas))
        for replica, error in zip(replicas, results, strict=True):
            await self._record(replica, error)

    async def check_one(self, replica: Replica) -> None:
        """Probe one replica now (an admin undrain need not wait for the next round),
        and wait for its admission if that probe starts one."""
        if replica.state in CHECKED:
            await self._record(replica, await self._probe(replica))
            admitting = self._admitting.get(replica.id)
            if admitting is not None:
                await asyncio.gather(admitting, return_exceptions=True)

    async def _probe(self, replica: Replica) -> str | None:
        """None if healthy, else why not."""
        try:
            resp = await self._client.get(
                replica.url + "/health", timeout=self._config.health_timeout_s
            )
        except httpx.TimeoutException:
            return f"/health timed out after {self._config.health_timeout_s:g} s"
        except httpx.HTTPError as exc:
            return f"/health failed: {type(exc).__name__}"
        if resp.status_code != 200:
            return f"/health answered {resp.status_code}"
        if self._config.route_around_paused and await self._paused(replica):
            return PAUSED
        return None

    async def _paused(self, replica: Replica) -> bool:
        if self._own_pause is not None and self._own_pause(replica):
            return False
        try:
            resp = await self._client.get(replica.url + "/is_paused",
                                          timeout=self._config.health_timeout_s)
            return resp.status_code == 200 and resp.json().get("is_paused") is True
        except (httpx.HTTPError, ValueError, AttributeError):
            return False  # /health just answered: the engine is up, whatever this says

    async def _record(self, replica: Replica, error: str | None) -> None:
        if replica.state not in CHECKED:  # the admin path took it while we probed
            return
        if error == PAUSED:
            replica.last_error = error
            self._pool.mark_down(replica, error)
            return
        if error is not None and replica.has_been_ready and self._on_failure is not None:
            self._on_failure(replica)
        verdict = next_state(
            replica.state, error is None, replica.health_successes, replica.health_failures,
            down_after=self._config.unhealthy_threshold, up_after=self._config.healthy_threshold,
        )
        replica.health_successes, replica.health_failures = verdict.successes, verdict.failures
        if error is not None:
            replica.last_error = error
        elif replica.state is ReplicaState.READY:
            replica.last_error = None  # a blip it recovered from
        if verdict.state is replica.state:
            return
        if verdict.state is ReplicaState.READY:
            if replica.id not in self._admitting:
                task = asyncio.create_task(self._admit_replica(replica),
                                           name=f"dpserve-admit-{replica.id}")
                self._admitting[replica.id] = task
                task.add_done_callback(lambda _: self._admitting.pop(replica.id, None))
        else:
            self._pool.set_state(
                replica, verdict.state,
                f"{replica.health_failures} health checks failed, last: {error}",
            )

    async def _admit_replica(self, replica: Replica) -> None:
        found = await self._fetch_models(replica)
        if found is None or replica.state not in CHECKED:
            return
        replica.models, replica.max_model_len = found
        problem = await self._admit(replica) if self._admit is not None else None
        if problem is not None:
            replica.last_error = problem
            log.warning("replica %s: healthy, not admitted yet: %s", replica.id, problem)
        elif replica.state in CHECKED and replica.health_failures == 0:
            self._pool.set_state(replica, ReplicaState.READY, "health checks pass")

    async def admitted(self) -> None:
        """Wait for the admissions under way (each ends admitted or not)."""
        while self._admitting:
            await asyncio.gather(*self._admitting.values(), return_exceptions=True)

    async def aclose(self) -> None:
        """Cancel the admissions under way."""
        tasks = list(self._admitting.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _fetch_models(self, replica: Replica) -> tuple[frozenset[str], int | None] | None:
        """The names a replica serves and its context length (the largest its base
        models report: an adapter's card names a parent); None if it cannot tell."""
        try:
            resp = await self._client.get(
                replica.url + "/v1/models", timeout=self._config.health_timeout_s
            )
            resp.raise_for_status()
            cards = resp.json()["data"]
            lengths = [m["max_model_len"] for m in cards if m.get("parent") is None
                       and type(m.get("max_model_len")) is int and m["max_model_len"] > 0]
            return frozenset(m["id"] for m in cards), max(lengths, default=None)
        except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError) as exc:
            log.warning("replica %s: healthy but /v1/models failed (%s); not admitting yet",
                        replica.id, exc)
            return None


class EngineScraper:
    """Reads every ready replica's `/metrics` on an interval for the `engine-load` policy.

    The parse is pure (`parse_engine_metrics`); the result is stored with the
    router's in-flight count of the same instant (`ReplicaPool.record_engine_load`,
    with no await in between), which is what lets the policy correct a stale
    scrape with what the router sent since. A failed scrape keeps the last one;
    the policy ignores scrapes older than its `max_age_s`.
    """

    def __init__(self, pool: ReplicaPool, config: RouterConfig, client: httpx.AsyncClient,
                 ) -> None:
        self._pool = pool
        self._config = config
        self._client = client

    async def run(self) -> None:
        while True:
            await self.scrape_all()
            await asyncio.sleep(self._config.engine_scrape_interval_s)

    async def scrape_all(self) -> None:
        await asyncio.gather(*(self._scrape(r) for r in self._pool.ready()))

    async def _scrape(self, replica: Replica) -> None:
        try:
            resp = await self._client.get(replica.url + "/metrics",
                                          timeout=self._config.health_timeout_s)
            resp.raise_for_status()
        except httpx.HTTPError as exc:
            log.debug("replica %s: /metrics failed (%s)", replica.id, exc)
            return
        self._pool.record_engine_load(replica, parse_engine_metrics(resp.text),
                                      time.monotonic())
