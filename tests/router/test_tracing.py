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

from dpserve.config import ConfigError, build_router_config
from tests.conftest import running_router
from tests.fake_tokens import expected_text
from tests.otlp import OtlpReceiver
from tests.router.migration_helpers import COMPLETION, all_ready, final, stream, text

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
