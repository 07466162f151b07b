"""The leader's `/metrics` for a router of several workers: data-plane families summed."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator

import prometheus_client
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dpserve.router.fleet.pool import Replica, ReplicaPool
from dpserve.router.kv.decisions import CACHED_BUCKETS, FALLBACK_REASONS, KVRoutingStats
from dpserve.router.kv.index import KVIndex
from dpserve.router.kv.metrics import KVCollector
from dpserve.router.telemetry.merge import SUMMED_FAMILIES, merge_exposition
from dpserve.router.telemetry.metrics import RouterMetrics


@pytest.fixture(autouse=True)
def created_series() -> Iterator[None]:
    """`_created` series on, whatever an earlier test left (`dpserve`'s CLI turns them off
    process-wide): the merge must keep the earliest worker's."""
    was = prometheus_client.metrics._use_created
    prometheus_client.enable_created_metrics()
    yield
    if not was:
        prometheus_client.disable_created_metrics()

COMPLETIONS = "/v1/completions"
Key = tuple[str, tuple[tuple[str, str], ...]]


def router_metrics(*replicas: str) -> RouterMetrics:
    ids = replicas or ("r0",)
    return RouterMetrics(ReplicaPool([Replica(id=r, url=f"http://{r}") for r in ids]))


def samples(text: bytes) -> dict[Key, float]:
    """Every sample of an exposition, by name and sorted labels (which must parse)."""
    return {key(s.name, **s.labels): s.value
            for f in text_string_to_metric_families(text.decode()) for s in f.samples}


def key(name: str, **labels: str) -> Key:
    return name, tuple(sorted(labels.items()))


def is_summed(sample: str) -> bool:
    """Whether a sample (by its name) belongs to a family of SUMMED_FAMILIES."""
    return sample in SUMMED_FAMILIES or any(
        sample.endswith(suffix) and sample[:-len(suffix)] in SUMMED_FAMILIES
        for suffix in ("_total", "_bucket", "_count", "_sum", "_created"))


def family_names(text: bytes) -> list[str]:
    return [f.name for f in text_string_to_metric_families(text.decode())]


def test_data_plane_counters_gauges_and_histograms_are_summed_over_workers():
    leader, one, two = router_metrics(), router_metrics(), router_metrics()
    leader.requests.labels(COMPLETIONS, "r0", "2xx").inc()
    one.requests.labels(COMPLETIONS, "r0", "2xx").inc(3)
    two.requests.labels(COMPLETIONS, "r0", "2xx").inc(5)
    leader.request_duration.labels(COMPLETIONS).observe(0.2)
    one.request_duration.labels(COMPLETIONS).observe(0.2)
    one.request_duration.labels(COMPLETIONS).observe(7.0)
    two.front_rejections.labels("malformed").inc()
    one.queue_depth.set(2)
    two.queue_depth.set(1)

    got = samples(merge_exposition(leader.render(), [one.render(), two.render()],
                                   SUMMED_FAMILIES))

    assert got[key("dpserve_requests_total", route=COMPLETIONS, replica="r0",
                   status_class="2xx")] == 9
    duration = "dpserve_request_duration_seconds"
    assert got[key(f"{duration}_bucket", route=COMPLETIONS, le="0.25")] == 2
    assert got[key(f"{duration}_bucket", route=COMPLETIONS, le="10.0")] == 3
    assert got[key(f"{duration}_bucket", route=COMPLETIONS, le="+Inf")] == 3
    assert got[key(f"{duration}_count", route=COMPLETIONS)] == 3
    assert got[key(f"{duration}_sum", route=COMPLETIONS)] == pytest.approx(7.4)
    assert got[key("dpserve_front_rejections_total", reason="malformed")] == 1
    assert got[key("dpserve_queue_depth")] == 3


def test_every_summed_sample_is_the_sum_of_the_workers_and_created_the_earliest():
    one = router_metrics()  # made first: its series were created earliest
    leader, two = router_metrics(), router_metrics()
    for worker, n in ((leader, 1), (one, 2), (two, 4)):
        worker.retries.labels(COMPLETIONS).inc(n)
        worker.queue_wait.labels(COMPLETIONS).observe(0.01 * n)
    texts = [leader.render(), one.render(), two.render()]

    merged = samples(merge_exposition(texts[0], texts[1:], SUMMED_FAMILIES))

    each = [samples(t) for t in texts]
    summed = [k for k in merged if is_summed(k[0])]
    assert any(name.endswith("_created") for name, _ in summed)
    for k in summed:
        values = [s.get(k, 0.0) for s in each]
        want = min(values) if k[0].endswith("_created") else sum(values)
        assert merged[k] == pytest.approx(want), k
    created = key("dpserve_request_retries_created", route=COMPLETIONS)
    assert merged[created] == each[1][created]


def test_leader_only_families_are_the_leaders_alone():
    leader, follower = router_metrics(), router_metrics("r0", "r1")
    leader.health_check_failures.labels("r0").inc()
    follower.health_check_failures.labels("r0").inc(5)
    follower.set_breaker_state("r0", "open")
    follower.deploys.labels("failed").inc()

    got = samples(merge_exposition(leader.render(), [follower.render()], SUMMED_FAMILIES))

    assert got[key("dpserve_health_check_failures_total", replica="r0")] == 1
    assert got[key("dpserve_replica_breaker_state", replica="r0", state="closed")] == 1
    assert got[key("dpserve_deploys_total", outcome="failed")] == 0
    own = samples(leader.render())
    assert {k: v for k, v in got.items() if not is_summed(k[0])} == {
        k: v for k, v in own.items() if not is_summed(k[0])}


def test_label_sets_only_a_follower_has_are_added():
    leader, follower = router_metrics(), router_metrics("r0", "r1")
    follower.requests.labels(COMPLETIONS, "r1", "2xx").inc(2)
    follower.adapter_requests.labels("sql-lora").inc()

    got = samples(merge_exposition(leader.render(), [follower.render()], SUMMED_FAMILIES))

    assert got[key("dpserve_requests_total", route=COMPLETIONS, replica="r1",
                   status_class="2xx")] == 2
    assert got[key("dpserve_adapter_requests_total", adapter="sql-lora")] == 1
    assert key("dpserve_adapter_requests_created", adapter="sql-lora") in got
    # r1 is in the follower's pool only: the leader's pool gauges do not show it.
    assert key("dpserve_replica_in_flight_requests", replica="r1") not in got


def test_a_summed_family_only_a_follower_has_comes_after_the_leaders():
    leader, follower = router_metrics(), router_metrics()
    failures = Counter("dpserve_trace_export_failures_total", "Batches not delivered",
                       registry=follower.registry)  # as app.py declares it, with tracing on
    failures.inc(3)

    merged = merge_exposition(leader.render(), [follower.render()], SUMMED_FAMILIES)

    names, own = family_names(merged), family_names(leader.render())
    assert names == [*own, "dpserve_trace_export_failures",
                     "dpserve_trace_export_failures_created"]
    assert samples(merged)[key("dpserve_trace_export_failures_total")] == 3


def test_without_followers_the_answer_is_the_leaders_own():
    leader = router_metrics()
    leader.requests.labels(COMPLETIONS, "r0", "5xx").inc()
    leader.time_to_first_byte.labels(COMPLETIONS).observe(0.12)
    own = leader.render()

    assert merge_exposition(own, [], SUMMED_FAMILIES) == own
    assert merge_exposition(own, [b"", b""], SUMMED_FAMILIES) == own


def test_a_follower_text_that_does_not_fit_is_left_out_with_a_warning(caplog):
    leader, follower = router_metrics(), router_metrics()
    follower.requests.labels(COMPLETIONS, "r0", "2xx").inc(4)
    own, good = leader.render(), follower.render()
    bad = [b"garbage{", b"\xff\xfe not utf-8", good[:len(good) // 2] + b"{",
           b"# TYPE dpserve_queue_depth counter\ndpserve_queue_depth_total 7\n"]

    with caplog.at_level(logging.WARNING, logger="dpserve.router"):
        merged = merge_exposition(own, [*bad, good], SUMMED_FAMILIES)

    assert merged == merge_exposition(own, [good], SUMMED_FAMILIES)
    assert samples(merged)[key("dpserve_requests_total", route=COMPLETIONS, replica="r0",
                               status_class="2xx")] == 4
    warnings = [r for r in caplog.records if r.name == "dpserve.router"]
    assert len(warnings) == len(bad)
    assert all(r.levelno == logging.WARNING for r in warnings)


def kv_routing(on_events: int) -> KVCollector:
    """`kv-aware`'s series, `on_events` requests placed on events."""
    stats = KVRoutingStats(on_events=on_events, prompt_tokens=100 * on_events,
                           cached_tokens=50 * on_events,
                           fallbacks=dict.fromkeys(FALLBACK_REASONS, 1),
                           cached_histogram=[on_events] + [0] * len(CACHED_BUCKETS))
    index = KVIndex()
    index.apply("r0", 0, [])
    return KVCollector(index, lambda: {"r0": "following"}, stats, lambda: {})


def test_every_summed_family_is_a_router_metric():
    leader = router_metrics()
    Counter("dpserve_trace_export_failures_total", "", registry=leader.registry)
    leader.registry.register(kv_routing(0))
    assert set(SUMMED_FAMILIES) <= set(family_names(leader.render()))


def test_kv_aware_decisions_are_summed_over_the_workers_and_its_index_is_the_leaders():
    texts = []
    for placed in (3, 4):
        registry = CollectorRegistry()
        registry.register(kv_routing(placed))
        texts.append(generate_latest(registry))
    merged = samples(merge_exposition(texts[0], texts[1:], SUMMED_FAMILIES))
    assert merged[key("dpserve_kv_routing_decisions_total", basis="events")] == 7
    assert merged[key("dpserve_kv_routing_decisions_total", basis="no_tokens")] == 2
    assert merged[key("dpserve_kv_routed_tokens_total", kind="cached")] == 350
    assert merged[key("dpserve_kv_cached_prefix_tokens_count")] == 7
    assert merged[key("dpserve_kv_index_blocks", replica="r0")] == 0  # not doubled
    assert merged[key("dpserve_kv_events_following", replica="r0")] == 1


ROUTES = (COMPLETIONS, "/v1/chat/completions", "/tokenize")
REPLICAS = ("r0", "r1", "r2")
WAITS = (0.0005, 0.003, 0.02, 0.4, 3.0, 100.0)
worker_events = st.lists(st.tuples(st.sampled_from(ROUTES), st.sampled_from(REPLICAS),
                                   st.integers(1, 5), st.sampled_from(WAITS)), max_size=8)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(worker_events, min_size=1, max_size=3))
def test_merged_totals_are_the_sums_and_buckets_stay_cumulative(workers):
    texts = []
    for events in workers:
        metrics = router_metrics()
        for route, replica, n, wait in events:
            metrics.requests.labels(route, replica, "2xx").inc(n)
            metrics.queue_wait.labels(route).observe(wait)
        texts.append(metrics.render())

    merged = merge_exposition(texts[0], texts[1:], SUMMED_FAMILIES)

    families = list(text_string_to_metric_families(merged.decode()))
    got = {key(s.name, **s.labels): s.value for f in families for s in f.samples}
    events = [e for w in workers for e in w]
    for route in ROUTES:
        for replica in REPLICAS:
            want = sum(n for r, p, n, _ in events if (r, p) == (route, replica))
            assert got.get(key("dpserve_requests_total", route=route, replica=replica,
                               status_class="2xx"), 0.0) == want
    queue_wait = next(f for f in families if f.name == "dpserve_queue_wait_seconds")
    for route in ROUTES:
        buckets = [(float(s.labels["le"]), s.value) for s in queue_wait.samples
                   if s.name.endswith("_bucket") and s.labels["route"] == route]
        bounds = [le for le, _ in buckets]
        counts = [c for _, c in buckets]
        assert bounds == sorted(bounds) and bounds[-1] == math.inf
        assert counts == sorted(counts)
        assert counts[-1] == sum(1 for r, *_ in events if r == route)


# Lines of the text format around two summed families, often valid and often not: what a
# follower's corrupted, truncated or mismatched text would hold.
lines = st.one_of(
    st.sampled_from(["# TYPE dpserve_queue_depth gauge", "# TYPE dpserve_queue_depth counter",
                     "# TYPE dpserve_queue_wait_seconds histogram", "# HELP dpserve_queue_depth",
                     "garbage", ""]),
    st.builds("{}{}{} {}".format,
              st.sampled_from(["dpserve_queue_depth", "dpserve_queue_wait_seconds"]),
              st.sampled_from(["", "_bucket", "_count", "_sum", "_total", "_created"]),
              st.sampled_from(["", "{}", '{route="/tokenize"}', '{le="0.5",route="/tokenize"}',
                               '{le="+Inf",route="/tokenize"}', '{le="x"}', '{route="a"']),
              st.sampled_from(["1", "-3", "nan", "+Inf", "x", ""])),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(lines, max_size=8).map(lambda ls: "\n".join(ls).encode()) | st.binary())
def test_no_follower_text_breaks_the_leaders_answer(follower):
    registry = CollectorRegistry()
    Gauge("dpserve_queue_depth", "Waiting requests", registry=registry).set(2)
    Histogram("dpserve_queue_wait_seconds", "Wait", ["route"], buckets=(0.5, 1.0),
              registry=registry).labels("/tokenize").observe(0.7)

    merged = merge_exposition(generate_latest(registry), [follower], SUMMED_FAMILIES)

    assert key("dpserve_queue_wait_seconds_count", route="/tokenize") in samples(merged)
