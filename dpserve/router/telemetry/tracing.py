"""OpenTelemetry traces: one span per request in the router, its context sent on.

Off unless an OTLP endpoint is configured (`router.otlp_traces_endpoint`, which
defaults to the standard `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`); off, the proxy holds
no `Tracing`
and pays one `is None` per request. On, each request gets a server span
(`POST /v1/completions`) whose parent is the client's W3C `traceparent` when it sent a
valid one (else a new trace), with the route, model, replica, attempts, queue wait,
time to first byte, status, and stream migrations; the request goes to the replica
with the router span's `traceparent` in place of the client's, so vLLM (started with
`--otlp-traces-endpoint`) puts its own `llm_request` span under it. Spans leave in
batches on the SDK's thread over OTLP/HTTP (protobuf); sampling follows the standard
`OTEL_TRACES_SAMPLER`/`OTEL_TRACES_SAMPLER_ARG` (default: always, or as the client's
trace was sampled), the service name `OTEL_SERVICE_NAME` (default `dpserve-router`).

An endpoint that cannot be reached costs nothing on the data plane: failed exports
are counted (`dpserve_trace_export_failures_total`) and logged once, not per batch.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from prometheus_client import Counter

from dpserve.router.headers import TRACE_HEADERS

__all__ = ["Span", "Tracing"]

log = logging.getLogger("dpserve.tracing")

_PROPAGATOR = TraceContextTextMapPropagator()

MAX_ATTRIBUTE_CHARS = 256
"""Longest attribute value a span keeps, whatever a client sent. A span waits in the
batch queue (up to 2,048 of them) until it is exported: uncapped, a 4 MiB string set as
an attribute is held per span there and sent in every export. The router records only
names it resolved (`Exchange.span_attributes`); this cap is the second line. It is
longer than any model, adapter or replica name the router accepts; a failed attempt's
reason is cut at it."""


def span_limits() -> SpanLimits:
    """Bounds on one span (OpenTelemetry's span limits), set here rather than from the
    `OTEL_*_LIMIT` variables, whose defaults leave attribute length unbounded."""
    return SpanLimits(max_span_attributes=32, max_events=16, max_links=4,
                      max_event_attributes=8, max_link_attributes=8,
                      max_attribute_length=MAX_ATTRIBUTE_CHARS,
                      max_span_attribute_length=MAX_ATTRIBUTE_CHARS)


class _CountingExporter(SpanExporter):
    """The OTLP exporter, its failures counted and logged once (until it recovers)."""

    def __init__(self, inner: SpanExporter, failures: Counter) -> None:
        self._inner = inner
        self._failures = failures
        self._failing = False

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            result = self._inner.export(spans)
        except Exception as exc:  # the SDK's thread must go on
            result = SpanExportResult.FAILURE
            detail = f"{type(exc).__name__}: {exc}"
        else:
            detail = "the collector refused them or did not answer"
        if result is SpanExportResult.FAILURE:
            self._failures.inc()
            if not self._failing:
                log.warning("cannot export traces (%s); serving goes on, failures are "
                            "counted in dpserve_trace_export_failures_total", detail)
            self._failing = True
        elif self._failing:
            log.info("traces are exported again")
            self._failing = False
        return result

    def shutdown(self) -> None:
        self._inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._inner.force_flush(timeout_millis)


class Tracing:
    """The router's tracer; `close()` flushes what is left."""

    def __init__(self, endpoint: str, failures: Counter, *,
                 exporter: SpanExporter | None = None) -> None:
        service = os.environ.get("OTEL_SERVICE_NAME") or "dpserve-router"
        self.endpoint = endpoint
        self._provider = TracerProvider(resource=Resource.create({"service.name": service}),
                                        span_limits=span_limits())
        inner = exporter if exporter is not None else OTLPSpanExporter(endpoint=endpoint,
                                                                       timeout=5)
        # The exporter's own per-batch warnings would repeat; ours says it once.
        logging.getLogger("opentelemetry.exporter.otlp.proto.http.trace_exporter").setLevel(
            logging.ERROR)
        self._provider.add_span_processor(BatchSpanProcessor(_CountingExporter(inner, failures)))
        self._tracer = self._provider.get_tracer("dpserve.router")

    def begin(self, method: str, route: str, headers: list[tuple[bytes, bytes]]) -> Span:
        """The request's span, a child of the client's trace if it sent a valid one."""
        carrier = {k.decode("latin-1"): v.decode("latin-1") for k, v in headers
                   if k in TRACE_HEADERS}
        parent = _PROPAGATOR.extract(carrier) if carrier else otel_context.Context()
        return self._tracer.start_span(f"{method} {route}", context=parent,
                                       kind=SpanKind.SERVER,
                                       attributes={"http.request.method": method,
                                                   "http.route": route})

    @staticmethod
    def header_lines(span: Span) -> bytes:
        """`traceparent` (and `tracestate`) of `span`, as lines of an HTTP head."""
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=set_span_in_context(span))
        return b"".join(f"{k}: {v}\r\n".encode("latin-1") for k, v in carrier.items())

    @staticmethod
    def end(span: Span, status: int, attributes: dict[str, Any]) -> None:
        span.set_attributes({k: v for k, v in attributes.items() if v is not None})
        span.set_attribute("http.response.status_code", status)
        if status >= 500:
            span.set_status(Status(StatusCode.ERROR, f"HTTP {status}"))
        span.end()

    def close(self) -> None:
        self._provider.shutdown()
