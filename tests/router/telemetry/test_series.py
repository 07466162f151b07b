"""Series from the start: every `dpserve_*` series the dashboard and the alert rules read
has a sample in a freshly started router's first scrape, and a replica that leaves the
fleet takes its series with it.

A counter that only appears at its first event shows "No data" on a healthy fleet and
is invisible to `rate()`/`increase()` at that event (deploy/grafana/dpserve.json,
deploy/prometheus/rules.yml). The replicas here are the shared fake engine
(tests/fakes.py `FakeReplica`): the router's own series do not depend on the engine.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from dpserve.config import DnsTarget, RouterConfig
from dpserve.router.fleet.discovery import Discovery
from dpserve.router.fleet.pool import Replica, ReplicaPool, ReplicaState
from dpserve.router.http.app import FORWARDED_ROUTES
from dpserve.router.routing.dispatch import Dispatcher
from dpserve.router.routing.policies import RequestInfo, make_policy
from dpserve.router.telemetry.metrics import ROUTES, RouterMetrics
from tests.conftest import running_router
from tests.deploy.test_grafana import metric_names
from tests.router.fleet.test_discovery import StubResolver
from tests.waiting import wait_for

DEPLOY = Path(__file__).resolve().parents[3] / "deploy"

GPU_SERIES = {
    name: "read from NVML at scrape time: only where `dpserve serve` found GPUs"
    for name in ("dpserve_gpu_utilization_ratio", "dpserve_gpu_memory_used_bytes",
                 "dpserve_gpu_memory_total_bytes", "dpserve_gpu_power_watts",
                 "dpserve_gpu_temperature_celsius", "dpserve_gpu_energy_joules_total")
}
PROCESS_SERIES = {
    name: "read from the replicas' process trees: only `dpserve serve` on a machine "
          "without GPUs has them (a router in front of remote replicas has no processes)"
    for name in ("dpserve_replica_cpu_utilization_ratio", "dpserve_replica_memory_rss_bytes")
}
KV_SERIES = {
    name: "routing on KV events: only a router with `--policy kv-aware` has them (per "
          "replica once it publishes events); tests/router/kv/test_two_routers_sim.py"
    for name in ("dpserve_kv_routing_decisions_total", "dpserve_kv_routed_tokens_total",
                 "dpserve_kv_index_blocks", "dpserve_kv_event_lag_seconds",
                 "dpserve_kv_event_gaps_total", "dpserve_kv_event_replays_total",
                 "dpserve_kv_event_resyncs_total", "dpserve_kv_events_following",
                 "dpserve_kv_relayed_prompts_total")
}
PEER_SERIES = {
    name: "the channel between routers: only a router with `--peer` has them; "
          "tests/router/peers/test_peers_sim.py"
    for name in ("dpserve_peers_live", "dpserve_peer_reports_received_total",
                 "dpserve_peer_reports_rejected_total", "dpserve_peer_prompts_total")
}
ROUTER_EXCEPTIONS = {**GPU_SERIES, **PROCESS_SERIES, **KV_SERIES, **PEER_SERIES}
"""Series a router in front of engines it did not start never has, and why. `vllm:*`
series are not checked at all: engines export them (the router federates them on
/metrics/engines)."""


def expressions() -> list[str]:
    """Every PromQL expression of the dashboard's panels and of the alert rules."""
    dashboard = json.loads((DEPLOY / "grafana" / "dpserve.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    rules = yaml.safe_load((DEPLOY / "prometheus" / "rules.yml").read_text())
    exprs += [r["expr"] for group in rules["groups"] for r in group["rules"]]
    return exprs


def referenced_series() -> set[str]:
    """The `dpserve_*` sample names (`_total`, `_bucket`, ... as queried) they read."""
    return {name for expr in expressions() for name in metric_names(expr)
            if name.startswith("dpserve_")}


def sample_names(text: str) -> set[str]:
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


def missing(text: str, exceptions: dict[str, str]) -> set[str]:
    """Referenced series with no sample in `text` (a /metrics answer), less `exceptions`."""
    return referenced_series() - set(exceptions) - sample_names(text)


def test_the_dashboard_and_rules_reference_the_series_the_issue_found_empty():
    assert {"dpserve_engine_scrape_errors_total", "dpserve_queue_wait_seconds_bucket",
            "dpserve_replica_reloads_total", "dpserve_replica_restarts_total",
            "dpserve_requests_total"} <= referenced_series()


def test_every_exception_is_a_series_the_dashboard_or_rules_read():
    assert set(ROUTER_EXCEPTIONS) <= referenced_series()


def test_the_metric_routes_are_the_forwarded_routes():
    assert set(ROUTES) == {path for path, _ in FORWARDED_ROUTES}


async def test_a_fresh_routers_first_scrape_has_every_series_the_dashboard_reads(
        fake_replicas):
    replicas = [await fake_replicas("a"), await fake_replicas("b")]
    async with running_router([r.url for r in replicas]) as (url, _):
        async with httpx.AsyncClient() as client:
            text = (await client.get(url + "/metrics")).text
    assert missing(text, ROUTER_EXCEPTIONS) == set()
    # ... at 0 (no event yet), and for each replica where the series is per replica.
    families = {f.name: f for f in text_string_to_metric_families(text)}
    reloads = families["dpserve_replica_reloads"].samples
    assert {(s.labels["replica"], s.labels["outcome"]) for s in reloads
            if s.name.endswith("_total")} == {
        (r, o) for r in ("r0", "r1") for o in ("succeeded", "failed", "rolled_back")}
    for name in ("dpserve_replica_restarts", "dpserve_engine_scrape_errors",
                 "dpserve_health_check_failures"):
        totals = {s.labels["replica"]: s.value for s in families[name].samples
                  if s.name.endswith("_total")}
        assert totals == {"r0": 0.0, "r1": 0.0}, name


def test_the_check_names_a_series_that_has_no_sample():
    metrics = RouterMetrics(ReplicaPool([Replica(id="r0", url="http://127.0.0.1:1")]))
    metrics.registry.unregister(metrics.replica_restarts)
    assert missing(metrics.render().decode(), ROUTER_EXCEPTIONS) == {
        "dpserve_replica_restarts_total"}


def replica_labels(metrics: RouterMetrics) -> set[str]:
    text = metrics.render().decode()
    return {s.labels["replica"] for f in text_string_to_metric_families(text)
            for s in f.samples if "replica" in s.labels}


async def test_a_replica_found_by_discovery_has_series_from_0_and_drops_them_when_it_leaves():
    pool = ReplicaPool([])
    metrics = RouterMetrics(pool)
    found = Discovery(pool, DnsTarget("engine.ns.svc", 8000), interval_s=1.0,
                      resolver=StubResolver(["10.0.0.1", "10.0.0.2"], ["10.0.0.2"]))
    await found.refresh()
    assert replica_labels(metrics) == {"10.0.0.1:8000", "10.0.0.2:8000", "none"}
    metrics.replica_reloads.labels("10.0.0.1:8000", "failed").inc()
    metrics.requests.labels("/v1/completions", "10.0.0.1:8000", "2xx").inc()
    await found.refresh()
    assert replica_labels(metrics) == {"10.0.0.2:8000", "none"}


def test_what_a_request_on_a_departed_replica_counts_later_is_swept_at_the_next_scrape():
    now = [0.0]
    pool = ReplicaPool([Replica(id="r0", url="http://127.0.0.1:1"),
                        Replica(id="r1", url="http://127.0.0.1:2")])
    metrics = RouterMetrics(pool, clock=lambda: now[0])
    pool.remove("r1", "gone from DNS")
    # a stream that was still on r1 breaks after it left
    metrics.stream_errors.labels("/v1/completions", "r1").inc()
    assert replica_labels(metrics) == {"r0", "none"}
    now[0] = 7200.0  # long after: the sweep has forgotten r1 ...
    metrics.render()
    pool.add(Replica(id="r1", url="http://127.0.0.1:2"))  # ... and r1 may come back
    assert replica_labels(metrics) == {"r0", "r1", "none"}


async def test_the_demand_gauge_counts_queued_and_in_flight_requests():
    pool = ReplicaPool([Replica(id="r0", url="http://127.0.0.1:1"),
                        Replica(id="r1", url="http://127.0.0.1:2")])
    for r in pool:
        pool.set_state(r, ReplicaState.READY)
    metrics = RouterMetrics(pool)
    dispatcher = Dispatcher(pool, make_policy("round-robin"), RouterConfig())

    def demand() -> float:
        text = metrics.render().decode()
        (value,) = [s.value for f in text_string_to_metric_families(text)
                    for s in f.samples if s.name == "dpserve_requests_outstanding"]
        return value

    assert demand() == 0.0
    with contextlib.ExitStack() as held:
        for _ in range(3):
            held.enter_context(await dispatcher.choose(RequestInfo(route="/v1/completions"),
                                                       tried=[]))
        metrics.queue_depth.set(4)  # as Router.refresh_gauges sets it before a scrape
        assert demand() == 7.0
        pool.remove("r0", "gone from DNS")  # its requests still finish: still demand
        assert demand() == 7.0
    metrics.queue_depth.set(0)
    assert demand() == 0.0


async def test_a_replica_that_leaves_and_comes_back_counts_its_requests_again(fake_replicas):
    a = await fake_replicas("a")
    async with running_router([a.url]) as (base, router), httpx.AsyncClient() as c:
        assert (await c.post(base + "/v1/completions", json={"model": "fake-model"})).is_success
        router.pool.remove("r0", "gone from DNS")
        router.pool.add(Replica(id="r0", url=a.url))
        await wait_for(lambda: router.pool.ready(), "r0 back in rotation")
        assert (await c.post(base + "/v1/completions", json={"model": "fake-model"})).is_success
        text = (await c.get(base + "/metrics")).text
    served = [line for line in text.splitlines()
              if line.startswith('dpserve_requests_total{replica="r0",route="/v1/completions"'
                                 ',status_class="2xx"}')]
    assert served == ['dpserve_requests_total{replica="r0",route="/v1/completions",'
                      'status_class="2xx"} 1.0'], served  # the request after it came back
