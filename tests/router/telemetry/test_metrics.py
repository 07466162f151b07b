"""The router's metric declarations: names, units, bounded labels."""

from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dpserve.router.fleet.pool import Replica, ReplicaPool
from dpserve.router.telemetry.metrics import BREAKER_STATES, RouterMetrics
from tests.conftest import running_router
from tests.waiting import wait_for

# Every label a router metric may carry: each has a small, known set of values.
# `adapter` takes only names an operator deployed (requests naming others are not counted);
# `metric` and `of` name an eval score (2 x 2 values).
BOUNDED_LABELS = {"route", "replica", "status_class", "state", "outcome", "reason", "adapter",
                  "metric", "of", "verdict", "action", "check", "bound"}
"""Each a small fixed set (a canary's `verdict` passed/failed/inconclusive, `action`
promoted/rolled_back, `check` and `bound` a few names each) or one per replica."""


def router_metrics() -> RouterMetrics:
    return RouterMetrics(ReplicaPool([Replica(id="r0", url="http://127.0.0.1:1")]))


def test_every_router_metric_is_dpserve_named_with_bounded_labels():
    metrics = router_metrics()
    families = list(metrics.registry.collect())
    assert len(families) >= 17
    for family in families:
        assert family.name.startswith("dpserve_"), family.name
    for attr in vars(metrics).values():
        labelnames = getattr(attr, "_labelnames", ())
        assert set(labelnames) <= BOUNDED_LABELS, (attr, labelnames)


def test_queue_health_breaker_and_deploy_metrics_are_declared():
    text = router_metrics().render().decode()
    names = {f.name for f in text_string_to_metric_families(text)}
    assert {"dpserve_queue_depth", "dpserve_queue_wait_seconds",
            "dpserve_health_check_failures", "dpserve_replica_breaker_state",
            "dpserve_deploys", "dpserve_deploy_duration_seconds", "dpserve_replica_reloads",
            "dpserve_replica_reload_duration_seconds", "dpserve_engine_scrape_errors"} <= names


def test_breaker_state_is_one_for_the_current_state_only():
    metrics = router_metrics()
    metrics.set_breaker_state("r0", "open")
    metrics.set_breaker_state("r0", "half_open")
    text = metrics.render().decode()
    got = {s.labels["state"]: s.value for f in text_string_to_metric_families(text)
           if f.name == "dpserve_replica_breaker_state" for s in f.samples}
    assert got == {"closed": 0.0, "open": 0.0, "half_open": 1.0}
    assert set(got) == set(BREAKER_STATES)
    with pytest.raises(ValueError, match="breaker state"):
        metrics.set_breaker_state("r0", "ajar")


def test_time_to_first_byte_buckets_resolve_sub_second_slos():
    metrics = router_metrics()
    metrics.time_to_first_byte.labels("/v1/completions").observe(0.12)
    text = metrics.render().decode()
    bounds = {s.labels["le"] for f in text_string_to_metric_families(text)
              if f.name == "dpserve_time_to_first_byte_seconds" for s in f.samples
              if s.name.endswith("_bucket")}
    for slo in ("0.1", "0.2", "0.5", "1.0", "2.0"):
        assert slo in bounds


def _lag(text: str) -> tuple[float, float]:
    """(samples, samples above 0.25 s) of dpserve_event_loop_lag_seconds."""
    samples = {(s.name, s.labels.get("le")): s.value
               for f in text_string_to_metric_families(text)
               if f.name == "dpserve_event_loop_lag_seconds" for s in f.samples}
    count = samples[("dpserve_event_loop_lag_seconds_count", None)]
    return count, count - samples[("dpserve_event_loop_lag_seconds_bucket", "0.25")]


async def test_a_held_event_loop_shows_in_the_lag_histogram(fake_replicas):
    replica = await fake_replicas("r0")
    async with running_router([replica.url]) as (url, _), httpx.AsyncClient() as client:
        await wait_for(lambda: _scraped(client, url), "the lag watch's first samples")
        _, late_before = _lag((await client.get(f"{url}/metrics")).text)
        time.sleep(0.4)  # noqa: ASYNC251 - on purpose: it holds the router's loop (this test's)
        await wait_for(lambda: _late(client, url, late_before),
                       "the 400 ms hold counted above 0.25 s")
        count, late = _lag((await client.get(f"{url}/metrics")).text)
    assert late >= late_before + 1
    assert count > late  # the wake-ups before and after it were on time


async def _scraped(client: httpx.AsyncClient, url: str) -> bool:
    return _lag((await client.get(f"{url}/metrics")).text)[0] >= 3


async def _late(client: httpx.AsyncClient, url: str, before: float) -> bool:
    return _lag((await client.get(f"{url}/metrics")).text)[1] > before
