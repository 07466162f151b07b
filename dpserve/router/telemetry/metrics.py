"""Every metric the router exports, declared in one place.

Names start with `dpserve_`, values are in base units, labels are bounded:
`route` is the route template (a handful of fixed paths), `replica` the replica
id, `status_class` one of 2xx/3xx/4xx/5xx. Gauges that mirror the pool (in
flight, state) are read from it at scrape time rather than kept twice.

Every series a dashboard or an alert reads has a sample from the first scrape:
children of closed label sets (routes, outcomes, reasons) are made at 0 when
the metrics are, and a replica's at 0 when it joins the pool. A counter that
only appeared at its first event would show "No data" on a healthy fleet, and
`rate()`/`increase()` would miss that first event (there is no earlier sample to
count from). A replica that leaves the pool (DNS discovery) drops its series,
so a fleet that scales keeps its label sets bounded by the replicas it has.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from dpserve.router.fleet.pool import Replica, ReplicaPool
from dpserve.router.telemetry.collectors import (
    DemandCollector,
    PoolCollector,
    WeightVersionCollector,
)
from dpserve.router.telemetry.loop_lag import LAG_BUCKETS
from dpserve.router.telemetry.merge import SUMMED_FAMILIES, merge_exposition

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Request latency spans sub-millisecond tokenize calls to minutes-long generations.
LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)
# Time to first token: SLOs sit between 100 ms and a few seconds, so the buckets are
# dense there (a p99 read from these is off by at most one bucket's width).
FIRST_BYTE_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0,
    5.0, 10.0, 30.0, 60.0,
)
# Waiting for a free replica: zero when the fleet keeps up, seconds when it does not.
QUEUE_WAIT_BUCKETS = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)
# A replica's hot-load takes seconds; a rolling deploy over a fleet, minutes.
DEPLOY_BUCKETS = (1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 3600.0)

BREAKER_STATES = ("closed", "open", "half_open")
"""Values of `state` on dpserve_replica_breaker_state."""
DEPLOY_OUTCOMES = ("succeeded", "failed", "rolled_back")
"""Values of `outcome` on the deploy and reload counters."""


FRONT_REJECTIONS = ("header_timeout", "body_timeout", "header_too_large",
                    "too_many_connections", "idle_reclaimed", "malformed", "upgrade")
"""Values of `reason` on dpserve_front_rejections_total (dpserve.router.http.front.REASONS)."""


ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/tokenize",
          "/detokenize", "/v1/models")
"""Values of `route`: the paths the router forwards (dpserve.router.http.app.FORWARDED_ROUTES)."""
STATUS_CLASSES = ("1xx", "2xx", "3xx", "4xx", "5xx", "other")
"""Values of `status_class` (`status_class()`)."""
REPLICA_STATUS_CLASSES = ("2xx", "4xx", "5xx")
"""The classes made at 0 for each replica: what a forwarded request ends with (vLLM
sends no 1xx or 3xx), so an error ratio reads 0, not "No data", before the first error."""
ROUTER_STATUS_CLASSES = ("4xx", "5xx")
"""The classes made at 0 for `replica="none"` (answered by the router itself: refused,
or no replica could serve)."""
LEFT_SWEEP_S = 3600.0
"""How long a replica's series are swept again after it left the pool: a request still
on it when it left may finish (and count) later, which would bring a series back."""


def status_class(status: int) -> str:
    return f"{status // 100}xx" if 100 <= status < 600 else "other"


class RouterMetrics:
    """The router's metrics, in a registry of its own (no process-global state)."""

    def __init__(self, pool: ReplicaPool, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "dpserve_requests",
            "Requests answered, by the replica that served them ('none' if the router "
            "answered itself), route template and HTTP status class.",
            ["route", "replica", "status_class"],
            registry=self.registry,
        )
        self.request_duration = Histogram(
            "dpserve_request_duration_seconds",
            "Time from receiving a request to sending the last byte of its response.",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.time_to_first_byte = Histogram(
            "dpserve_time_to_first_byte_seconds",
            "Time from receiving a request to the first byte of its answer from a replica "
            "(for streams, and completions assembled from one: roughly time to first "
            "token).",
            ["route"],
            buckets=FIRST_BYTE_BUCKETS,
            registry=self.registry,
        )
        self.loop_lag = Histogram(
            "dpserve_event_loop_lag_seconds",
            "How late the router's event loop woke for a timer, sampled 20 times a "
            "second: how long any ready step of a request (a chunk to relay) waited "
            "for the loop, held by other work or by the process waiting for a core.",
            buckets=LAG_BUCKETS,
            registry=self.registry,
        )
        self.retries = Counter(
            "dpserve_request_retries",
            "Requests sent to another replica because the chosen one could not be reached.",
            ["route"],
            registry=self.registry,
        )
        self.stream_errors = Counter(
            "dpserve_stream_errors",
            "Responses cut after they started (replica died, stream idle too long), "
            "where the stream could not move to another replica.",
            ["route", "replica"],
            registry=self.registry,
        )
        self.migrations = Counter(
            "dpserve_migrations",
            "Streams whose replica failed after they started, by why (disconnected, "
            "stalled) and what the router did: migrated (continued on another replica), "
            "failed (no replica could continue it), refused (it could not be continued "
            "as the same request: see dpserve_migration_refusals_total).",
            ["reason", "outcome"],
            registry=self.registry,
        )
        self.migration_refusals = Counter(
            "dpserve_migration_refusals",
            "Broken streams not migrated because a continuation would not be the same "
            "request, by what stood in the way (n, logprobs, stop_strings, ...; "
            "docs/serving.md lists them) or by a limit (limit, max_tokens).",
            ["reason"],
            registry=self.registry,
        )
        self.client_disconnects = Counter(
            "dpserve_client_disconnects",
            "Requests whose client went away before the response ended; the replica "
            "request is closed so the engine aborts it.",
            ["route"],
            registry=self.registry,
        )
        self.front_rejections = Counter(
            "dpserve_front_rejections",
            "Client connections the router's HTTP front closed on a limit or malformed "
            "input: reason is header_timeout, body_timeout, header_too_large, "
            "too_many_connections, idle_reclaimed (an idle keep-alive connection closed at "
            "the cap to admit a new one), malformed or upgrade.",
            ["reason"],
            registry=self.registry,
        )
        for reason in FRONT_REJECTIONS:  # every series present from the start
            self.front_rejections.labels(reason)
        self.replica_restarts = Counter(
            "dpserve_replica_restarts",
            "Replica processes restarted by the supervisor after they died.",
            ["replica"],
            registry=self.registry,
        )

        # Queueing, health, circuit breaking, rolling deploys (all labels bounded:
        # route templates, replica ids, BREAKER_STATES, DEPLOY_OUTCOMES).
        self.queue_depth = Gauge(
            "dpserve_queue_depth",
            "Requests waiting in the router for a replica to take them.",
            registry=self.registry,
        )
        self.queue_wait = Histogram(
            "dpserve_queue_wait_seconds",
            "Time a request waited in the router before a replica was chosen for it.",
            ["route"],
            buckets=QUEUE_WAIT_BUCKETS,
            registry=self.registry,
        )
        self.health_check_failures = Counter(
            "dpserve_health_check_failures",
            "Health checks of a replica that failed (timeout, error, or not 200) after it "
            "had been ready since its last start; a start-up's failing checks are not counted.",
            ["replica"],
            registry=self.registry,
        )
        self.breaker_state = Gauge(
            "dpserve_replica_breaker_state",
            "1 for the circuit-breaker state each replica is in, 0 for the others "
            f"({', '.join(BREAKER_STATES)}).",
            ["replica", "state"],
            registry=self.registry,
        )
        self.deploys = Counter(
            "dpserve_deploys",
            f"Rolling deploys of new weights, by outcome ({', '.join(DEPLOY_OUTCOMES)}).",
            ["outcome"],
            registry=self.registry,
        )
        for outcome in DEPLOY_OUTCOMES:  # from 0, so increase() sees the first failure
            self.deploys.labels(outcome)
        self.adapter_requests = Counter(
            "dpserve_adapter_requests",
            "Requests that named a LoRA adapter, by adapter name (its versions together; "
            "names are few: each one is deployed by an operator).",
            ["adapter"],
            registry=self.registry,
        )
        self.deploy_duration = Histogram(
            "dpserve_deploy_duration_seconds",
            "Time a rolling deploy took over the whole fleet, whatever its outcome.",
            buckets=DEPLOY_BUCKETS,
            registry=self.registry,
        )
        self.deploy_eval_score = Gauge(
            "dpserve_deploy_eval_score",
            "The last scored deploy's eval set (--eval), by metric (exact_match, "
            "mean_logprob) and `of`: candidate (the version deployed) or current (the one "
            "it would replace).",
            ["metric", "of"],
            registry=self.registry,
        )
        self.canary_windows = Counter(
            "dpserve_canary_windows",
            "Deploy canary windows, by verdict (passed, failed, inconclusive) and what the "
            "deploy did (promoted, rolled_back).",
            ["verdict", "action"],
            registry=self.registry,
        )
        self.canary_last = Gauge(
            "dpserve_canary_last",
            "The last canary window's verdict: `check` ttft_ratio (the canary's TTFT over "
            "its baseline's) or error_rate_difference, `bound` estimate, low or high (the "
            "interval at the window's confidence), or `check` answers by `bound` canary or "
            "baseline (how many were compared).",
            ["check", "bound"],
            registry=self.registry,
        )
        self.replica_reloads = Counter(
            "dpserve_replica_reloads",
            "Weight hot-loads of one replica (pause, reload, reset cache, canary, resume), "
            "by outcome.",
            ["replica", "outcome"],
            registry=self.registry,
        )
        self.replica_reload_duration = Histogram(
            "dpserve_replica_reload_duration_seconds",
            "Time one replica spent out of rotation for a hot-load.",
            buckets=DEPLOY_BUCKETS,
            registry=self.registry,
        )
        self.engine_scrape_errors = Counter(
            "dpserve_engine_scrape_errors",
            "Replica /metrics fetches that failed while serving /metrics/engines; that "
            "replica's series were left out of the answer.",
            ["replica"],
            registry=self.registry,
        )

        self.registry.register(PoolCollector(pool))
        self.registry.register(WeightVersionCollector(pool))
        self.registry.register(DemandCollector(pool, self.queue_depth))

        for route in ROUTES:  # from 0, like every closed label set (module docstring)
            for child in (self.request_duration, self.time_to_first_byte, self.retries,
                          self.queue_wait, self.client_disconnects):
                child.labels(route)
            for sc in ROUTER_STATUS_CLASSES:
                self.requests.labels(route, "none", sc)
        self._clock = clock
        self.others: Callable[[], list[bytes]] | None = None
        """With data-plane workers: the other workers' own metrics, summed into these."""
        self._left: dict[str, float] = {}
        """Replicas that left the pool -> when; swept at each render for LEFT_SWEEP_S."""
        for replica in pool:
            self.add_replica(replica.id)
        pool.on_membership(lambda r: self.add_replica(r.id), self._replica_left)

    def render(self) -> bytes:
        self._sweep()
        return generate_latest(self.registry)

    async def render_all(self) -> bytes:
        """`render`, with the other workers' data-plane counts summed in (merged on a
        thread: parsing the workers' texts costs ~10 ms each, too long for the loop)."""
        own = self.render()
        if self.others is None:
            return own
        return await asyncio.to_thread(merge_exposition, own, self.others(), SUMMED_FAMILIES)

    def answered(self) -> float:
        """Requests this process answered, over every route, replica and status."""
        return sum(s.value for m in self.requests.collect() for s in m.samples
                   if s.name.endswith("_total"))

    def add_replica(self, replica: str) -> None:
        """Make every series of `replica` at 0 (its breaker closed): a replica that joins
        shows on the dashboards at once, and its first failure counts in `increase()`."""
        self._left.pop(replica, None)
        for route in ROUTES:
            for sc in REPLICA_STATUS_CLASSES:
                self.requests.labels(route, replica, sc)
            self.stream_errors.labels(route, replica)
        for counter in (self.health_check_failures, self.replica_restarts,
                        self.engine_scrape_errors):
            counter.labels(replica)
        for outcome in DEPLOY_OUTCOMES:
            self.replica_reloads.labels(replica, outcome)
        self.set_breaker_state(replica, "closed")

    def remove_replica(self, replica: str) -> None:
        """Drop every series labelled `replica` (the replica left the fleet for good)."""
        for route in ROUTES:
            for sc in STATUS_CLASSES:
                _remove(self.requests, route, replica, sc)
            _remove(self.stream_errors, route, replica)
        for counter in (self.health_check_failures, self.replica_restarts,
                        self.engine_scrape_errors):
            _remove(counter, replica)
        for outcome in DEPLOY_OUTCOMES:
            _remove(self.replica_reloads, replica, outcome)
        for state in BREAKER_STATES:
            _remove(self.breaker_state, replica, state)

    def _replica_left(self, replica: Replica) -> None:
        self.remove_replica(replica.id)
        self._left[replica.id] = self._clock()

    def _sweep(self) -> None:
        """Remove again what requests still on a departed replica counted since."""
        now = self._clock()
        for replica, left_at in list(self._left.items()):
            if now - left_at > LEFT_SWEEP_S:
                del self._left[replica]
            else:
                self.remove_replica(replica)

    def set_breaker_state(self, replica: str, state: str) -> None:
        """Mark `state` (one of BREAKER_STATES) as the replica's breaker state."""
        if state not in BREAKER_STATES:
            raise ValueError(f"breaker state {state!r} is not one of {BREAKER_STATES}")
        for s in BREAKER_STATES:
            self.breaker_state.labels(replica, s).set(1.0 if s == state else 0.0)


def _remove(metric: Counter | Gauge, *labels: str) -> None:
    with contextlib.suppress(KeyError):  # prometheus_client < 0.21 raises for a missing one
        metric.remove(*labels)
