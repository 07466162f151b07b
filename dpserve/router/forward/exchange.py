"""One client request on its way through the proxy (`dpserve.router.forward.proxy`)."""

from __future__ import annotations

from typing import Any

from dpserve.router.asgi import ReplyTracker
from dpserve.router.fleet.adapters import AdapterVersion
from dpserve.router.forward.assembled import Assembler
from dpserve.router.migration.tracked import Stream
from dpserve.router.routing.policies import RequestInfo
from dpserve.router.telemetry.tracing import Span


class Exchange:
    """One client request on its way through the proxy: what every step reads."""

    __slots__ = ("adapter", "assembled", "attempts", "body", "client_model", "first_byte_s",
                 "headers", "info", "line", "migration", "model", "not_migratable", "payload",
                 "queue_wait_s", "replied", "request_id", "span", "start", "stream", "trace")

    def __init__(self, request_id: str, replied: ReplyTracker, start: float) -> None:
        self.request_id = request_id
        self.replied = replied
        self.start = start
        """`time.perf_counter()` when the request arrived."""
        self.body = b""
        self.info = RequestInfo(route="")
        self.payload: dict[str, Any] | None = None
        """The parsed body, kept only while the policy needs its token ids."""
        self.stream = False
        """The replica is asked for a stream (the client's, or one the router assembles)."""
        self.assembled: Assembler | None = None
        """A non-streamed request riding on a stream: where its events go, for the
        client's one JSON answer (`dpserve.router.forward.assembled`)."""
        self.line = b""
        """The upstream request line less its version: `POST /v1/completions?query`."""
        self.headers = b""
        """The upstream header block after `host`, blank line included."""
        self.adapter: AdapterVersion | None = None
        """The adapter version the request runs on, if it names an adapter."""
        self.client_model = ""
        """The `model` the client sent (answers are renamed back to it)."""
        self.model: str | None = None
        """The `model` named, once known to be one the fleet serves (a base model a
        ready replica reported, or an adapter resolved): what the trace span records.
        A name the client made up is never recorded, whatever its length."""
        self.migration: Stream | None = None
        """A stream that may move to another replica if its own fails mid-way."""
        self.not_migratable = ""
        """Why a stream may not (`eligibility.refusal`), counted if it breaks."""
        self.span: Span | None = None
        """The request's trace span, when tracing is on (`dpserve.router.telemetry.tracing`)."""
        self.trace = b""
        """Its `traceparent` lines for the replica."""
        self.attempts = 0
        self.queue_wait_s = 0.0
        self.first_byte_s: float | None = None

    def span_attributes(self, served_by: str) -> dict[str, Any]:
        """What its trace span records at the end (None: left out)."""
        return {
            "dpserve.request_id": self.request_id, "dpserve.replica": served_by,
            "gen_ai.request.model": self.model,
            "dpserve.stream": self.stream and self.assembled is None,
            "dpserve.attempts": self.attempts, "dpserve.queue_wait_s": self.queue_wait_s,
            "dpserve.time_to_first_byte_s": self.first_byte_s,
            "dpserve.migrations": len(self.migration.state.seams) if self.migration else None,
            "dpserve.adapter": self.adapter.engine_name if self.adapter else None}
