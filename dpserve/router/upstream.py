"""HTTP/1.1 to the replicas: pooled keep-alive connections parsed by httptools.

The data plane's upstream client. It does what forwarding needs and nothing
else: write the request in one buffer, parse the response with llhttp (through
httptools, the parser uvicorn serves us with), hand its body over chunk by
chunk as it arrives, and keep the connection for the next request when the
response ended cleanly. Per request that is a fraction of aiohttp's client
work (request and response objects, header multidicts, cookie and redirect
handling, timer tasks), which was the largest single cost in the router's
profile.

A connection is reused only if it stayed idle less than `IDLE_REUSE_S`, under
the keep-alive timeout vLLM's server applies (5 s), so a request is never
written onto a connection the replica is closing. A response that was not read
to the end closes its connection: vLLM sees the disconnect and aborts the
generation.

The connection itself, and the framing rules that decide whether it is reused,
are in `dpserve.router.http1`; its errors are re-exported here.
"""

from __future__ import annotations

import asyncio
import functools
import ssl
import time
from collections import deque
from dataclasses import dataclass
from urllib.parse import urlsplit

from dpserve.router.http1 import (
    ConnectFailed,
    Connection,
    ConnectTimeout,
    Disconnected,
    ResponseTooLarge,
    UpstreamResponse,
)

__all__ = ["ConnectFailed", "ConnectTimeout", "Disconnected", "Origin", "ResponseTooLarge",
           "UpstreamPool", "UpstreamResponse"]

IDLE_REUSE_S = 4.0
"""Reuse an idle connection only this long (vLLM's uvicorn closes it after 5 s)."""
MAX_IDLE_PER_REPLICA = 512


@dataclass(frozen=True, slots=True)
class Origin:
    """Where a replica listens, parsed once from its base URL."""

    host: str
    port: int
    tls: bool
    host_header: bytes

    @classmethod
    def parse(cls, base_url: str) -> Origin:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        tls = parts.scheme == "https"
        port = parts.port or (443 if tls else 80)
        return cls(parts.hostname, port, tls, parts.netloc.encode("idna"))


class UpstreamPool:
    """Keep-alive connections to each replica, opened on demand."""

    def __init__(self) -> None:
        self._idle: dict[Origin, deque[Connection]] = {}
        self._closed = False
        self._tls: ssl.SSLContext | None = None

    async def request(self, origin: Origin, head: bytes, body: bytes, *,
                      connect_timeout_s: float | None, head_timeout_s: float | None,
                      ) -> UpstreamResponse:
        """Send `head` (request line and headers, ending in a blank line) and `body`;
        return once the response's status and headers arrived."""
        if self._closed:
            raise RuntimeError("the upstream pool is closed")
        conn = self._reusable(origin) or await self._connect(origin, connect_timeout_s)
        head_arrived = conn.send(head, body)
        # A timer that fails the future, cheaper than asyncio.timeout's task cancellation.
        timer = (asyncio.get_running_loop().call_later(head_timeout_s, conn.head_timed_out,
                                                       head_timeout_s)
                 if head_timeout_s is not None else None)
        try:
            return await head_arrived
        except BaseException:
            conn.close()  # a late response must not land on a reused connection
            raise
        finally:
            if timer is not None:
                timer.cancel()

    def _reusable(self, origin: Origin) -> Connection | None:
        idle = self._idle.get(origin)
        now = time.monotonic()
        while idle:
            conn = idle.pop()  # the most recently used: the least likely to be timed out
            if not conn.closed and now - conn.idle_since < IDLE_REUSE_S:
                return conn
            conn.close()
        return None

    async def _connect(self, origin: Origin, timeout_s: float | None) -> Connection:
        loop = asyncio.get_running_loop()
        tls = None
        if origin.tls:
            tls = self._tls = self._tls or ssl.create_default_context()
        try:
            async with asyncio.timeout(timeout_s):
                on_idle = functools.partial(self._put, origin)
                _, conn = await loop.create_connection(
                    lambda: Connection(on_idle), origin.host, origin.port, ssl=tls)
        except TimeoutError:
            raise ConnectTimeout(f"no connection to {origin.host}:{origin.port} within "
                                 f"{timeout_s:g} s") from None
        except OSError as exc:
            raise ConnectFailed(exc.errno, f"cannot connect to {origin.host}:{origin.port}: "
                                           f"{exc.strerror or exc}") from None
        return conn

    def _put(self, origin: Origin, conn: Connection) -> None:
        if self._closed or conn.closed:
            conn.close()
            return
        idle = self._idle.setdefault(origin, deque())
        if len(idle) >= MAX_IDLE_PER_REPLICA:
            idle.popleft().close()
        conn.idle_since = time.monotonic()
        idle.append(conn)

    def close(self) -> None:
        """Close every idle connection; connections in use close when released."""
        self._closed = True
        for idle in self._idle.values():
            while idle:
                idle.pop().close()
        self._idle.clear()
