"""The router's HTTP/1.1 front: uvicorn's httptools protocol, with limits on clients.

uvicorn parses requests with llhttp but bounds none of what a client can make
the router hold: a connection that sends one header byte every few seconds
(slowloris), a head of megabytes (httptools keeps every partial header in
memory until it ends), a body that trickles, an idle connection opened and never
used, or thousands of them. :class:`GuardedProtocol` adds, per connection:

- a head deadline (`client_header_timeout_s`), counted from the connection's
  opening, or from the first byte of a later request on it: past it the
  connection is closed (408 first if the client had started a request);
- a head size cap (`max_header_bytes`), counted on the bytes received, before the
  parser buffers them: 431 and close;
- a body idle limit (`client_body_timeout_s`): the longest wait for the next
  piece of a body, not counting time the router itself stopped reading
  (flow control, a pipelined request waiting its turn): 408 and close;
- a connection cap (`max_connections`): a connection past it takes the place of
  one idle between requests, or, when none is, gets 503 at once.

A response's head goes out with its first body part, in one write
(`dpserve.router.http.front_cycle`). The keep-alive timeout between requests is
uvicorn's own. Malformed requests,
which uvicorn answers in plain text, get the OpenAI error envelope, as do the
refusals above. Protocol upgrades (WebSocket, h2c) are refused: the router
forwards none, and a request that switches protocols would leave its body bytes
unparsed on the connection.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from dpserve.router.errors import error_body
from dpserve.router.http.front_cycle import OneWriteCycle
from dpserve.router.telemetry.metrics import FRONT_REJECTIONS

log = logging.getLogger("dpserve.front")

LINGER_S = 2.0
"""How long a refused connection keeps reading (and discarding) before it closes."""
LINGER_BYTES = 16 * 1024 * 1024
"""...or how much it reads, whichever comes first."""
REASONS = FRONT_REJECTIONS
"""Why the front closed a connection (the `reason` label of its metric)."""


@dataclass(frozen=True, kw_only=True)
class FrontLimits:
    max_header_bytes: int
    header_timeout_s: float
    body_timeout_s: float
    max_connections: int
    on_reject: Callable[[str], None] | None = None
    """Told the reason each time the front refuses a request or connection."""


def protocol_factory(limits: FrontLimits) -> Callable[..., GuardedProtocol]:
    """What uvicorn's `Config(http=...)` takes: a protocol class bound to `limits`."""
    return functools.partial(GuardedProtocol, limits=limits)


class GuardedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the limits of :class:`FrontLimits`."""

    def __init__(self, *args: Any, limits: FrontLimits, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._limits = limits
        # One deadline per connection (the head's, the body's, the linger's), watched by
        # at most one timer: moving the deadline later re-arms nothing, the timer re-checks
        # when it fires. A request costs no timer of its own.
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._deadline = 0.0
        self._on_deadline: Callable[[], None] | None = None
        self._in_head = False
        self._head_bytes = 0
        self._in_body = False
        self._body_seen_at = 0.0
        self._lingering = False
        self._lingered = 0

    # -- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self._limits.max_connections and not self._reclaim_idle():
            self._refuse(503, "the router has as many connections open as it may; retry "
                              "shortly", "too_many_connections", retry_after_s=1, linger=False)
            return
        self._begin_head()  # an idle new connection gets the head's deadline too

    def _reclaim_idle(self) -> bool:
        """At the cap, close one connection idle between requests (its keep-alive timer
        running) to make room, as nginx does, rather than refuse a new client."""
        for other in self.connections:
            if (other is not self and isinstance(other, GuardedProtocol)
                    and other.timeout_keep_alive_task is not None
                    and not other.transport.is_closing()):
                other._report("idle_reclaimed")
                other.transport.close()
                return True
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._unset_keepalive_if_required()
        if self._lingering:
            self._lingered += len(data)
            if self._lingered > LINGER_BYTES:
                self.transport.close()
            return
        limit = self._limits.max_header_bytes
        try:
            while data and not self.transport.is_closing():
                if not self._in_head and not self._in_body:
                    self._begin_head()  # a request's first bytes, after the last one ended
                room = limit - self._head_bytes
                if not self._in_head or len(data) <= room:
                    self._head_bytes += len(data) if self._in_head else 0
                    self.parser.feed_data(data)
                    return
                # Feed only what the cap allows; the rest is the body or the next request.
                self._head_bytes = limit
                self.parser.feed_data(data[:room])
                if self._in_head:
                    self._refuse(431, f"request headers are larger than the limit of {limit} "
                                      "bytes", "header_too_large")
                    return
                data = data[room:]
        except httptools.HttpParserUpgrade:
            pass  # refused in on_headers_complete; the bytes after the head are not parsed
        except httptools.HttpParserError as exc:
            self._refuse(400, f"malformed HTTP request: {exc}", "malformed")

    def send_400_response(self, msg: str) -> None:
        self._refuse(400, msg, "malformed")

    def _start_asgi_task(self, cycle: Any, app: Any) -> None:
        # Every cycle, a pipelined one included, starts here before the app runs.
        cycle.__class__ = OneWriteCycle
        super()._start_asgi_task(cycle, app)

    # -- httptools callbacks ------------------------------------------------------------

    def on_message_begin(self) -> None:
        if not self._in_head:  # a pipelined request that began mid-chunk
            self._begin_head()
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._disarm()
        if self.parser.should_upgrade():
            self._refuse(400, "protocol upgrades are not supported", "upgrade")
            return
        self._in_body = True
        self._body_seen_at = self.loop.time()
        self._arm(self._limits.body_timeout_s, self._body_timed_out)
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        self._body_seen_at = self.loop.time()
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._in_body = False
        self._disarm()
        if self.cycle is not None:
            super().on_message_complete()

    # -- the limits ---------------------------------------------------------------------

    def _begin_head(self) -> None:
        self._in_head = True
        self._head_bytes = 0
        self._arm(self._limits.header_timeout_s, self._head_timed_out)

    def _arm(self, after_s: float, callback: Callable[[], None]) -> None:
        """Call `callback` in `after_s` unless disarmed or re-armed first."""
        self._deadline = self.loop.time() + after_s
        self._on_deadline = callback
        if self._timer is None or self._timer_at > self._deadline:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = self.loop.call_at(self._deadline, self._deadline_reached)
            self._timer_at = self._deadline

    def _disarm(self) -> None:
        self._on_deadline = None  # a pending timer finds nothing due

    def _deadline_reached(self) -> None:
        self._timer = None
        callback = self._on_deadline
        if callback is None:
            return
        if self.loop.time() + 0.001 < self._deadline:  # moved later since the timer was set
            self._timer = self.loop.call_at(self._deadline, self._deadline_reached)
            self._timer_at = self._deadline
            return
        self._on_deadline = None
        callback()

    def _head_timed_out(self) -> None:
        if self._head_bytes == 0:  # opened and never used: nothing to answer
            self._report("header_timeout")
            self.transport.close()
            return
        self._refuse(408, "request headers not received within "
                          f"{self._limits.header_timeout_s:g} s", "header_timeout")

    def _body_timed_out(self) -> None:
        now = self.loop.time()
        if self.flow.read_paused:  # the router stopped reading, not the client
            self._body_seen_at = now
        idle = now - self._body_seen_at
        if idle < self._limits.body_timeout_s:
            self._arm(self._limits.body_timeout_s - idle, self._body_timed_out)
            return
        self._refuse(408, f"request body stalled for {self._limits.body_timeout_s:g} s",
                     "body_timeout")

    def _refuse(self, status: int, message: str, reason: str, *,
                retry_after_s: int | None = None, linger: bool = True) -> None:
        """Answer `status` in the OpenAI envelope (unless a response already started)
        and close the connection; the request in progress, if any, sees a disconnect."""
        self._disarm()
        self._in_head = self._in_body = False
        self._report(reason)
        cycle = self.cycle
        started = cycle is not None and cycle.response_started and not cycle.response_complete
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # the app's next send is dropped; receive says so
            cycle.message_event.set()
        if not started and not self.transport.is_closing():
            body = error_body(status, message)
            head = [b"HTTP/1.1 %d %s\r\n" % (status, _PHRASES.get(status, b"Error")),
                    b"content-type: application/json\r\n",
                    b"content-length: %d\r\n" % len(body),
                    b"connection: close\r\n"]
            if retry_after_s is not None:
                head.append(b"retry-after: %d\r\n" % retry_after_s)
            self.transport.write(b"".join(head) + b"\r\n" + body)
        if linger and self._linger():
            return
        self.transport.close()

    def _linger(self) -> bool:
        """Half-close and discard what the client still sends for a moment, so the answer
        is read before the connection goes: closing with unread bytes makes the kernel
        reset it, and a reset can destroy the answer on the client's side (the client
        sending an 8 MiB head is still sending)."""
        transport = self.transport
        if transport.is_closing() or not transport.can_write_eof():
            return False
        transport.write_eof()
        self._lingering = True
        self._arm(LINGER_S, transport.close)
        return True

    def _report(self, reason: str) -> None:
        if self._limits.on_reject is not None:
            self._limits.on_reject(reason)
        log.debug("front: %s from %s", reason, self.client)


_PHRASES = {400: b"Bad Request", 408: b"Request Timeout", 431: b"Request Header Fields Too Large",
            503: b"Service Unavailable"}
