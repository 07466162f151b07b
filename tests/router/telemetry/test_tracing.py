"""Traces: a span per request in the router, its W3C context sent on to the replica.

Against a real OTLP/HTTP endpoint in the test (`tests.otlp`) and the shared fake
engine, which records the headers it got. What vLLM adds under the router's span is
checked on real replicas in tests/integration/test_tracing.py.
"""

from __future__ import annotations

import logging
import re

import httpx
import pytest
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from prometheus_client import CollectorRegistry, Counter

from dpserve.config import ConfigError, RouterConfig, build_router_config
from dpserve.router.fleet.pool import Replica, ReplicaPool
from dpserve.router.http.app import Router
from dpserve.router.telemetry.tracing import MAX_ATTRIBUTE_CHARS, Tracing
from tests.conftest import running_router, serving
from tests.fake_tokens import expected_text
from tests.otlp import OtlpReceiver
from tests.router.forward.test_adapter_proxy import ready_with, served
from tests.router.migration.helpers import COMPLETION, all_ready, final, stream, text

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}$")
BODY = {"model": "fake-model", "prompt": "hi"}


@pytest.fixture
def otlp():
    with OtlpReceiver() as receiver:
        yield receiver


def sent_on(replica) -> tuple[str, str]:
    """The trace id and parent span id the replica was given."""
    match = TRACEPARENT.match(replica.headers_seen[-1]["traceparent"])
    assert match is not None
    return match[1], match[2]


async def test_a_request_span_joins_the_clients_trace_and_parents_the_replicas(
        fake_replicas, otlp):
    a = await fake_replicas("a")
    async with running_router([a.url], otlp_traces_endpoint=otlp.url) as (base, _), \
            httpx.AsyncClient() as c:
        r = await c.post(base + "/v1/completions", json=BODY, headers={
            "traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01", "tracestate": "k=v"})
    assert r.status_code == 200
    (span,) = otlp.named("dpserve-router")  # flushed when the router closed
    assert (span.name, span.trace_id, span.parent_id) == (
        "POST /v1/completions", CLIENT_TRACE, CLIENT_SPAN)
    assert sent_on(a) == (CLIENT_TRACE, span.span_id)  # the engine's spans go under it
    assert a.headers_seen[-1].get("tracestate") == "k=v"  # carried, as the spec says
    assert span.attributes["http.response.status_code"] == 200
    assert span.attributes["dpserve.replica"] == "r0"
    assert span.attributes["gen_ai.request.model"] == "fake-model"
    assert span.attributes["dpserve.attempts"] == 1
    assert span.attributes["dpserve.request_id"] == r.headers["x-request-id"]
    assert span.attributes["dpserve.time_to_first_byte_s"] > 0


@pytest.mark.parametrize("header", ["garbage", f"00-{'0' * 32}-{CLIENT_SPAN}-01",
                                    f"ff-{CLIENT_TRACE}-{CLIENT_SPAN}-01"])
async def test_a_malformed_traceparent_starts_a_new_trace(fake_replicas, otlp, header):
    a = await fake_replicas("a")
    async with running_router([a.url], otlp_traces_endpoint=otlp.url) as (base, _), \
            httpx.AsyncClient() as c:
        r = await c.post(base + "/v1/completions", json=BODY, headers={"traceparent": header})
    assert r.status_code == 200
    (span,) = otlp.named("dpserve-router")
    assert span.parent_id == "" and span.trace_id != CLIENT_TRACE
    assert sent_on(a) == (span.trace_id, span.span_id)


async def test_a_retry_and_a_stream_that_moved_are_in_the_span(fake_replicas, otlp):
    down = await fake_replicas("down", mode="error503")
    a = await fake_replicas("a", tokens=True, cut_after_tokens=4)
    b = await fake_replicas("b", tokens=True)
    async with running_router([a.url, b.url], policy="round-robin",
                              otlp_traces_endpoint=otlp.url) as (base, router):
        await all_ready(router, 2)
        events = await stream(base, "/v1/completions", COMPLETION)
    assert text(events) == expected_text(COMPLETION, 12) and final(events)["dpserve"]
    (span,) = otlp.named("dpserve-router")
    assert span.attributes["dpserve.migrations"] == 1 and span.attributes["dpserve.stream"]
    continued = b.headers_seen[-1]["traceparent"]  # the continuation is in the trace too
    assert TRACEPARENT.match(continued)[1] == span.trace_id  # type: ignore[index]

    async with running_router([down.url, a.url], policy="round-robin",
                              otlp_traces_endpoint=otlp.url) as (base, router), \
            httpx.AsyncClient() as c:
        await all_ready(router, 2)
        a.cut_after_tokens = None
        r = await c.post(base + "/v1/completions", json=BODY)
    assert r.status_code == 200
    retried = otlp.named("dpserve-router")[-1]
    assert retried.attributes["dpserve.attempts"] == 2
    assert retried.events == ["attempt failed"]


async def test_a_model_name_the_client_made_up_never_reaches_a_span(fake_replicas, otlp):
    """A span records the model only once the router resolved it to a name the fleet
    serves: a 404's made-up name, however long, is not kept in the export queue nor
    sent to the collector (it was, whole: 4 MiB per request)."""
    a = await fake_replicas("a")
    adapters, v1 = served("support", "v1")  # with adapters the name is checked later
    router = Router(ReplicaPool([Replica("r0", a.url)]),
                    RouterConfig(health_interval_s=0.2, otlp_traces_endpoint=otlp.url),
                    adapters=adapters)
    made_up = "m" * (1024 * 1024)
    async with serving(router) as (base, _), httpx.AsyncClient() as c:
        await ready_with(router, v1.engine_name)
        refused = [(await c.post(base + "/v1/completions", json={
            "model": made_up + str(i), "prompt": "hi"})).status_code for i in range(3)]
        pinned = await c.post(base + "/v1/completions",
                              json={"model": "support@" + made_up, "prompt": "hi"})
        good = [(await c.post(base + "/v1/completions", json={
            "model": model, "prompt": "hi"})).status_code
            for model in ("fake-model", "support")]
    assert refused == [404] * 3 and pinned.status_code == 404 and good == [200, 200]
    spans = otlp.named("dpserve-router")
    assert len(spans) == 6
    assert [s.attributes.get("gen_ai.request.model") for s in spans] == [
        None, None, None, None, "fake-model", "support"]
    assert spans[-1].attributes["dpserve.adapter"] == "support@v1"
    assert otlp.bytes_received < 64 * 1024  # six spans, not megabytes of a client's name


class _Keep(SpanExporter):
    def __init__(self) -> None:
        self.spans: list = []

    def export(self, spans):  # type: ignore[no-untyped-def]
        self.spans.extend(spans)
        return SpanExportResult.SUCCESS


def test_every_attribute_and_event_a_span_holds_is_capped():
    """The second line: whatever reaches a span (a failed attempt's reason quoting a
    replica, a header a future change records) is cut to a bounded length and count."""
    kept = _Keep()
    tracing = Tracing("http://127.0.0.1:9/v1/traces",
                      Counter("failures", "x", registry=CollectorRegistry()), exporter=kept)
    span = tracing.begin("POST", "/v1/completions", [])
    for _ in range(30):
        span.add_event("attempt failed", {**{f"extra{j}": j for j in range(12)},
                                          "dpserve.reason": "x" * 100_000})
    Tracing.end(span, 502, {**{f"dpserve.more{i}": i for i in range(40)},
                            "dpserve.replica": "r" * 100_000})
    tracing.close()
    (done,) = kept.spans
    assert len(done.attributes["dpserve.replica"]) == MAX_ATTRIBUTE_CHARS
    assert len(done.attributes) <= 32 and len(done.events) <= 16
    assert all(len(e.attributes) <= 8 and len(e.attributes["dpserve.reason"])
               == MAX_ATTRIBUTE_CHARS for e in done.events)


async def test_an_unreachable_collector_costs_no_request_and_one_warning(
        fake_replicas, caplog, monkeypatch):
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    a = await fake_replicas("a")
    with OtlpReceiver() as gone:
        url = gone.url  # a port nothing listens on once it is closed
    caplog.set_level(logging.INFO, logger="dpserve.tracing")
    async with running_router([a.url], otlp_traces_endpoint=url) as (base, router), \
            httpx.AsyncClient() as c:
        statuses = [(await c.post(base + "/v1/completions", json=BODY)).status_code
                    for _ in range(5)]
    assert statuses == [200] * 5
    failures = router.metrics.registry.get_sample_value(
        "dpserve_trace_export_failures_total")
    assert failures is not None and failures >= 1
    warnings = [r for r in caplog.records if r.name == "dpserve.tracing"
                and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "cannot export traces" in warnings[0].getMessage()


async def test_without_tracing_the_clients_trace_context_passes_untouched(fake_replicas):
    a = await fake_replicas("a")
    header = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
    async with running_router([a.url]) as (base, router), httpx.AsyncClient() as c:
        await c.post(base + "/v1/completions", json=BODY, headers={"traceparent": header})
    assert router.tracing is None
    assert a.headers_seen[-1]["traceparent"] == header


def test_the_endpoint_comes_from_the_flag_or_the_standard_variable():
    std = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}
    assert build_router_config({}, env={}).otlp_traces_endpoint is None
    assert build_router_config({}, env=std).otlp_traces_endpoint == std[
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]
    assert build_router_config({"otlp_traces_endpoint": "https://x/v1/traces"},
                               env=std).otlp_traces_endpoint == "https://x/v1/traces"
    with pytest.raises(ConfigError, match=r"router\.otlp_traces_endpoint"):
        build_router_config({"otlp_traces_endpoint": "collector:4317"}, env={})
