"""An OTLP/HTTP traces endpoint for tests: it keeps every span it is sent.

What a collector receives, decoded with OpenTelemetry's own protobuf definitions
(`opentelemetry-proto`), in a thread of the test process so that a router in the
test's event loop and engines in other processes can export to it alike.
"""

from __future__ import annotations

import gzip
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, Any] = field(default_factory=dict)
    events: list[str] = field(default_factory=list)


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class OtlpReceiver:
    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.bytes_received = 0
        """Export requests' bytes, decompressed: what the spans cost on the wire."""
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                with receiver._lock:
                    receiver.bytes_received += len(body)
                receiver._take(ExportTraceServiceRequest.FromString(body))
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _take(self, request: ExportTraceServiceRequest) -> None:
        got = []
        for resource in request.resource_spans:
            attrs = {a.key: _value(a.value) for a in resource.resource.attributes}
            for scope in resource.scope_spans:
                for s in scope.spans:
                    got.append(ReceivedSpan(
                        service=str(attrs.get("service.name", "")), name=s.name,
                        trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                        parent_id=s.parent_span_id.hex(),
                        attributes={a.key: _value(a.value) for a in s.attributes}
                        | {f"resource.{k}": v for k, v in attrs.items()},
                        events=[e.name for e in s.events]))
        with self._lock:
            self.spans.extend(got)

    def named(self, service: str) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self.spans if s.service == service]
