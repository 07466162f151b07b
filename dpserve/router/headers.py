"""The header rules of a proxy hop: which client headers a replica gets, which of its
headers the client gets back, and the request id.

Pure functions of bytes and strings, shared by the forward path and the migrator (a
continuation is a request the router writes too), so they sit with the router's
common vocabulary and import none of its parts.
"""

from __future__ import annotations

import itertools
import re
import secrets
from collections.abc import Iterable, MutableMapping
from typing import Any

from dpserve.router.errors import RouterError

Scope = MutableMapping[str, Any]

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


def downstream_headers(raw_headers: Iterable[tuple[bytes, bytes]], request_id: str,
                       replica_id: str, base_version: str | None,
                       adapter_version: str | None = None) -> list[tuple[bytes, bytes]]:
    """A replica's headers less hop-by-hop ones, plus who answered with what: the
    weight version is the adapter's for a request on an adapter (then the base
    weights' version is `x-dpserve-base-version`)."""
    out = [(name.lower(), value) for name, value in raw_headers
           if name.lower() not in _NOT_PASSED_BACK]
    out.append((b"x-request-id", request_id.encode()))
    out.append((b"x-dpserve-replica", replica_id.encode()))
    base = base_version.encode("latin-1") if base_version else None
    if adapter_version is not None:
        out.append((b"x-dpserve-weight-version", adapter_version.encode()))
        if base is not None:
            out.append((b"x-dpserve-base-version", base))
    elif base is not None:
        out.append((b"x-dpserve-weight-version", base))
    return out
