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
the keep-alive timeout vLLM's server applies (5 s), so a request is not written
onto a connection the replica is closing. A replica whose event loop stalled past
that timeout (SIGSTOP, a long CPU step) still closes it when it wakes, before it
reads the request (uvloop runs due timers first): a reused connection closed with
no byte of answer is tried once more on a new connection, so that race is neither
an error for the client nor a failure of the replica. A response that was not read
to the end closes its connection: vLLM sees the disconnect and aborts the
generation.

The connection itself, and the framing rules that decide whether it is reused,
are in `dpserve.router.upstream.connection`; its errors are re-exported here.

The rest of the router sees the client through `UpstreamClient`: `open` builds the
request head (the one place it is built) and answers a context manager whose exit
releases the response, so no caller has to remember to. `Router(upstream=...)` takes
any implementation, as httpx takes a transport: tests and benchmarks answer from
memory with `UpstreamResponse.canned`.
"""

from __future__ import annotations

import asyncio
import functools
import ssl
import time
from collections import deque
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from types import TracebackType
from typing import Protocol
from urllib.parse import urlsplit

from dpserve.router.upstream.connection import (
    ConnectFailed,
    Connection,
    ConnectTimeout,
    Disconnected,
    ResponseTooLarge,
    UpstreamResponse,
)

__all__ = ["ConnectFailed", "ConnectTimeout", "Disconnected", "Origin", "ResponseTooLarge",
           "UpstreamClient", "UpstreamPool", "UpstreamResponse", "request_head"]

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


def request_head(target: bytes, origin: Origin, headers: bytes) -> bytes:
    """The request line and head: `target` is `POST /v1/completions?query`, `headers`
    the header block after `host`, ending in the blank line."""
    return b"%s HTTP/1.1\r\nhost: %s\r\n%s" % (target, origin.host_header, headers)


class UpstreamClient(Protocol):
    """What the data plane asks of its client to the replicas."""

    def open(self, origin: Origin, target: bytes, headers: bytes, body: bytes, *,
             connect_timeout_s: float | None, head_timeout_s: float | None,
             ) -> AbstractAsyncContextManager[UpstreamResponse]:
        """Send a request (`request_head` says what `target` and `headers` are); the
        response once its head arrived, released when the block is left."""
        ...

    def close(self) -> None:
        """Close what is idle; what is in use closes when released."""
        ...


class Opened:
    """`async with`: the response of one request, released on the way out (its
    connection kept only if the response was read to its end)."""

    __slots__ = ("_args", "_pool", "_resp")

    def __init__(self, pool: UpstreamPool, args: tuple[Origin, bytes, bytes, float | None,
                                                      float | None]) -> None:
        self._pool = pool
        self._args = args
        self._resp: UpstreamResponse | None = None

    async def __aenter__(self) -> UpstreamResponse:
        origin, head, body, connect_s, head_s = self._args
        self._resp = await self._pool.request(origin, head, body, connect_timeout_s=connect_s,
                                              head_timeout_s=head_s)
        return self._resp

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._resp is not None:
            self._resp.release()


class UpstreamPool:
    """Keep-alive connections to each replica, opened on demand (an `UpstreamClient`)."""

    def __init__(self) -> None:
        self._idle: dict[Origin, deque[Connection]] = {}
        self._closed = False
        self.stale_retries = 0
        """Requests sent again on a new connection because the replica closed the kept-
        alive one they went out on without answering."""
        self._tls: ssl.SSLContext | None = None

    def open(self, origin: Origin, target: bytes, headers: bytes, body: bytes, *,
             connect_timeout_s: float | None, head_timeout_s: float | None) -> Opened:
        return Opened(self, (origin, request_head(target, origin, headers), body,
                             connect_timeout_s, head_timeout_s))

    async def request(self, origin: Origin, head: bytes, body: bytes, *,
                      connect_timeout_s: float | None, head_timeout_s: float | None,
                      ) -> UpstreamResponse:
        """Send `head` (request line and headers, ending in a blank line) and `body`;
        return once the response's status and headers arrived. The caller releases it
        (`open` does that for it)."""
        if self._closed:
            raise RuntimeError("the upstream pool is closed")
        loop = asyncio.get_running_loop()
        deadline = None if head_timeout_s is None else (loop.time() + head_timeout_s,
                                                        head_timeout_s)
        reused = self._reusable(origin)
        conn = reused or await self._connect(origin, connect_timeout_s)
        try:
            return await self._exchange(conn, head, body, deadline)
        except Disconnected:
            if reused is None or conn.answered:
                raise
        # The replica closed a kept-alive connection as the request arrived and answered
        # nothing: its keep-alive timer fired first (an event loop that stalled past it:
        # SIGSTOP, a long step) and it read none of the request. Not an answer; once more
        # on a new connection, which a replica that is really gone refuses.
        self.stale_retries += 1
        conn = await self._connect(origin, connect_timeout_s)
        return await self._exchange(conn, head, body, deadline)

    @staticmethod
    async def _exchange(conn: Connection, head: bytes, body: bytes,
                        deadline: tuple[float, float] | None) -> UpstreamResponse:
        """One request on `conn`; the head must arrive by `deadline` (when, and the
        timeout it ends)."""
        head_arrived = conn.send(head, body)
        # A timer that fails the future, cheaper than asyncio.timeout's task cancellation.
        loop = asyncio.get_running_loop()
        timer = (loop.call_at(deadline[0], conn.head_timed_out, deadline[1])
                 if deadline is not None else None)
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
