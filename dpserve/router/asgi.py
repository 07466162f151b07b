"""Raw ASGI plumbing of the data plane: types, the reply tracker, the disconnect
watcher and the header rules of a proxy hop.

Raw ASGI rather than Starlette's Request/Response objects so a forwarded
request costs as little as possible.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import secrets
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from dpserve.router.adapters import AdapterVersion
from dpserve.router.errors import RouterError, error_body
from dpserve.router.pool import Replica
from dpserve.router.upstream import UpstreamResponse

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

REQUEST_ID_HEADER = "x-request-id"
REPLICA_HEADER = "x-dpserve-replica"
WEIGHT_VERSION_HEADER = "x-dpserve-weight-version"

# Headers that describe one hop, not the message (RFC 9110 §7.6.1), plus the
# ones each hop sets itself (host, length; `expect: 100-continue` was answered by
# the server in front, and the body is sent whole).
_HOP_BY_HOP = frozenset({
    b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
    b"trailer", b"transfer-encoding", b"upgrade", b"host", b"content-length", b"expect",
})
_NOT_PASSED_BACK = _HOP_BY_HOP | {b"date", b"server", REQUEST_ID_HEADER.encode()}
TRACE_HEADERS = frozenset({b"traceparent", b"tracestate"})
"""W3C trace context: replaced by the router span's when tracing is on."""
FORWARDED_HEADERS = frozenset({b"content-type", b"accept", b"user-agent",
                               b"x-session-id"}) | TRACE_HEADERS
"""The only client headers a replica gets (the router adds its own framing, `host` and
`x-request-id`). An allow-list, because vLLM 0.32 acts on headers a client must not
choose: `X-data-parallel-rank` picks an engine of a data-parallel server,
`X-Vllm-Priority` sets a request's scheduling priority, `endpoint-load-metrics-format`
puts the engine's load in the response's headers, `Authorization` is the client's
key, and a later version may add more. Kept: what describes the body and the answer
wanted, the client's name, the trace context, and `X-Session-ID` (the session vLLM
labels the request's cached blocks with, which the body's `session_id` sets too)."""
# Bytes no header value may hold (RFC 9110 §5.5): a CR or LF would start a new header
# line, or a new request, on the replica's side. Tab is allowed.
_BAD_VALUE = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")

# Request ids this router makes: a random per-process prefix and a counter, unique
# across router processes and restarts without uuid4's cost on every request.
_ID_PREFIX = secrets.token_hex(8)
_id_counter = itertools.count(1)


class ReplyTracker:
    """Wraps ASGI `send` and remembers whether the response has started."""

    __slots__ = ("_send", "finished", "started")

    def __init__(self, send: Send) -> None:
        self._send = send
        self.started = False
        self.finished = False

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.started = True
        await self._send({"type": "http.response.start", "status": status, "headers": headers})

    async def body(self, data: bytes, *, more: bool) -> None:
        self.finished = not more
        await self._send({"type": "http.response.body", "body": data, "more_body": more})


class DisconnectWatch:
    """Cancels the request's task if its client disconnects while it is served.

    The watching task (awaiting the server's `http.disconnect`) starts only once
    the request has lasted `after_s`: most proxied requests end sooner and pay for
    a timer instead of a task. A client that leaves earlier is noticed then.
    The server also reports `http.disconnect` once the response is complete;
    that one must not cancel anything, hence the `finished` check.
    """

    __slots__ = ("_receive", "_replied", "_task", "_timer", "_watcher", "fired")

    def __init__(self, receive: Receive, task: asyncio.Task[Any] | None,
                 replied: ReplyTracker, *, after_s: float = 0.05) -> None:
        self._receive = receive
        self._task = task
        self._replied = replied
        self._watcher: asyncio.Task[None] | None = None
        self.fired = False
        """Whether this watch cancelled the task (the client left)."""
        self._timer: asyncio.TimerHandle | None = asyncio.get_running_loop().call_later(
            after_s, self._start)

    def _start(self) -> None:
        self._timer = None
        self._watcher = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                if self._task is not None and not self._replied.finished:
                    self.fired = True
                    self._task.cancel()
                return

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._watcher is not None:
            self._watcher.cancel()


async def send_json_error(replied: ReplyTracker, exc: RouterError, request_id: str) -> None:
    body = error_body(exc.status, exc.message, param=exc.param)
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (REQUEST_ID_HEADER.encode(), request_id.encode()),
    ]
    if exc.retry_after_s is not None:
        headers.append((b"retry-after", str(exc.retry_after_s).encode()))
    await replied.start(exc.status, headers)
    await replied.body(body, more=False)


def request_id(scope: Scope) -> str:
    """The client's `X-Request-Id` when it is sane, else a new one."""
    for name, value in scope["headers"]:
        if name == b"x-request-id":
            text: str = value.decode("latin-1")
            if 0 < len(text) <= 128 and text.isprintable():
                return text
            break
    return f"{_ID_PREFIX}{next(_id_counter):016x}"


def upstream_header_block(scope: Scope, request_id: str, content_length: int | None,
                          trace: bytes = b"") -> bytes:
    """The client's headers for the replica, as the lines of an HTTP/1.1 head (the
    blank line included), with the request id and the body's length.

    Only `FORWARDED_HEADERS` pass, less those the client's `Connection` names (hop by
    hop); the router frames the body itself (`content_length`, or none for a bodiless
    request). RouterError(400) for a value holding a control character, which could
    split the head on the replica's side. With `trace` (the router span's
    `traceparent` lines) the client's trace headers give way to it.
    """
    headers = scope["headers"]
    allowed = FORWARDED_HEADERS - TRACE_HEADERS if trace else FORWARDED_HEADERS
    for name, value in headers:
        if name == b"connection":
            allowed = allowed - {t.strip().lower() for t in value.split(b",")}
    lines = []
    for name, value in headers:
        if name not in allowed:
            continue
        if _BAD_VALUE.search(value) is not None:
            raise RouterError(400, f"header {name.decode('latin-1')!r} holds a control "
                                   "character")
        lines.append(name + b": " + value + b"\r\n")
    lines.append(b"x-request-id: " + request_id.encode("latin-1") + b"\r\n")
    if trace:
        lines.append(trace)
    if content_length is not None:
        lines.append(b"content-length: %d\r\n" % content_length)
    lines.append(b"\r\n")
    return b"".join(lines)


def downstream_headers(
    resp: UpstreamResponse, request_id: str, replica: Replica,
    adapter: AdapterVersion | None = None,
) -> list[tuple[bytes, bytes]]:
    """The replica's headers less hop-by-hop ones, plus who answered with what: the
    weight version is the adapter's for a request on an adapter (then the base
    weights' version is `x-dpserve-base-version`)."""
    out = [(name.lower(), value) for name, value in resp.raw_headers
           if name.lower() not in _NOT_PASSED_BACK]
    out.append((b"x-request-id", request_id.encode()))
    out.append((b"x-dpserve-replica", replica.id.encode()))
    base = replica.weight_version.encode("latin-1") if replica.weight_version else None
    if adapter is not None:
        out.append((b"x-dpserve-weight-version", adapter.version.encode()))
        if base is not None:
            out.append((b"x-dpserve-base-version", base))
    elif base is not None:
        out.append((b"x-dpserve-weight-version", base))
    return out
