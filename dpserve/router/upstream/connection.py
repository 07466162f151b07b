"""One HTTP/1.1 connection to a replica, its response parsed by llhttp (httptools).

The protocol half of the data plane's upstream client (the pool of connections is
`dpserve.router.upstream.client`): write one request in one buffer, parse the response
as it arrives, hand its body over chunk by chunk (pausing the socket while much
waits to be forwarded), and say whether the connection may carry another request.

Framing is never guessed. A connection goes back to the pool only after a
response that ended by its own framing (Content-Length or chunked, not the end
of the connection) and announced keep-alive. Any byte past the end of a response
(a second response nobody asked for, as a smuggled request would produce), a
head larger than `MAX_HEAD_BYTES`, an upgrade, a response with both
Content-Length and Transfer-Encoding, or a Transfer-Encoding that is not chunked
closes the connection instead: the next request never reads another's answer.

Errors say what the replica could have seen: :class:`ConnectFailed` (it did
not get the request), :class:`ConnectTimeout`, :class:`Disconnected` (the
connection broke before the response ended), and :class:`TimeoutError` while
waiting for response bytes.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Iterable

import httptools

PAUSE_AT_BYTES = 1 << 18
"""Stop reading from the replica while this much of its body waits to be forwarded."""
MAX_HEAD_BYTES = 64 * 1024
"""Largest status line plus headers accepted from a replica (vLLM's are under 1 KiB)."""


class ConnectFailed(OSError):
    """The connection could not be made (refused, unreachable): nothing was sent."""


class ConnectTimeout(TimeoutError):
    """No connection within the connect timeout: nothing was sent."""


class Disconnected(ConnectionError):
    """The connection broke, or the response was malformed, before the response ended."""


class ResponseTooLarge(Exception):
    """A response body is larger than the caller's limit; the connection is closed."""


class UpstreamResponse:
    """A response whose head has arrived; its body is read with :meth:`readany` or
    :meth:`read`, and :meth:`release` must follow (it is idempotent)."""

    __slots__ = ("_buffered", "_conn", "_error", "_until_eof", "_waiter", "chunks",
                 "complete", "keep_alive", "raw_headers", "status")

    def __init__(self, conn: Connection | None) -> None:
        self._conn: Connection | None = conn
        self.status = 0
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self.keep_alive = False
        self.complete = False
        self.chunks: deque[bytes] = deque()
        self._buffered = 0
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._until_eof = False

    @classmethod
    def canned(cls, status: int, headers: list[tuple[bytes, bytes]], body: bytes,
               ) -> UpstreamResponse:
        """A whole response held in memory, on no connection: what a stand-in for the
        upstream client answers (tests, `benchmarks`)."""
        resp = cls(None)
        resp.status = status
        resp.raw_headers = list(headers)
        resp.keep_alive = resp.complete = True
        if body:
            resp.chunks.append(body)
            resp._buffered = len(body)
        return resp

    @property
    def content_type(self) -> str:
        for name, value in self.raw_headers:
            if name.lower() == b"content-type":
                return value.split(b";", 1)[0].strip().lower().decode("latin-1")
        return ""

    async def readany(self) -> bytes:
        """The body bytes that arrived since the last call (waiting for some);
        b"" once the body is complete. Raises :class:`Disconnected` if it broke."""
        while not self.chunks:
            if self._error is not None:
                raise self._error
            if self.complete:
                return b""
            await self._wait()
        data = self.chunks.popleft() if len(self.chunks) == 1 else b"".join(self._drain())
        self._buffered -= len(data)
        if self._conn is not None and self._buffered < PAUSE_AT_BYTES:
            self._conn.resume()
        return data

    async def read(self, limit: int | None = None) -> bytes:
        """The whole body; :class:`ResponseTooLarge` past `limit` bytes."""
        if self.complete and self._error is None and (limit is None or self._buffered <= limit):
            return self.body_so_far()  # the usual small response: all here
        parts = []
        size = 0
        while chunk := await self.readany():
            size += len(chunk)
            if limit is not None and size > limit:
                self.chunks.clear()  # release() closes the connection: the rest is unread
                raise ResponseTooLarge(f"the response is larger than {limit} bytes")
            parts.append(chunk)
        return b"".join(parts)

    def body_so_far(self) -> bytes:
        """What arrived and was not read yet, without waiting."""
        data = b"".join(self._drain())
        self._buffered = 0
        return data

    def release(self) -> None:
        """Give the connection back when the response ended cleanly by its own framing
        and was read to the end, else close it."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if (self.complete and self.keep_alive and self._error is None and not self.chunks
                and not self._until_eof):
            conn.idle()
        else:
            conn.close()

    def interrupt(self, error: BaseException) -> None:
        """End the body with `error` for its reader (what arrived before still comes
        first); `release` then closes the connection, so the replica aborts it."""
        self._fail(error)

    # -- fed by the connection ---------------------------------------------------------

    def _drain(self) -> Iterable[bytes]:
        while self.chunks:
            yield self.chunks.popleft()

    async def _wait(self) -> None:
        waiter = self._waiter = asyncio.get_running_loop().create_future()
        try:
            await waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _feed(self, data: bytes) -> None:
        self.chunks.append(data)
        self._buffered += len(data)
        if self._buffered >= PAUSE_AT_BYTES and self._conn is not None:
            self._conn.pause()
        self._wake()

    def _finish(self) -> None:
        self.complete = True
        self._wake()

    def _fail(self, error: BaseException) -> None:
        if not self.complete and self._error is None:
            self._error = error
        self._wake()


class Connection(asyncio.Protocol):
    """One TCP connection to a replica, carrying one request at a time."""

    def __init__(self, on_idle: Callable[[Connection], None]) -> None:
        self._on_idle = on_idle
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self._parser = httptools.HttpResponseParser(self)
        self._response: UpstreamResponse | None = None
        self._head: asyncio.Future[UpstreamResponse] | None = None
        self._paused = False
        self._head_bytes = 0
        """Bytes of the current response read before its head ended (capped)."""
        self._ended = False
        """The current request's final response ended: any further byte is out of step."""
        self.answered = False
        """A byte of the current request's answer arrived."""

    # -- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        self.answered = True
        response = self._response
        if response is None or self._ended:
            self.close()  # bytes nobody asked for: the stream is out of step
            return
        try:
            if self._head is not None:  # still in the head: bound what the parser buffers
                room = MAX_HEAD_BYTES - self._head_bytes
                if len(data) > room:
                    self._head_bytes = MAX_HEAD_BYTES
                    self._parser.feed_data(data[:room])
                    if self._head is not None and self._head_bytes == MAX_HEAD_BYTES:
                        raise Disconnected(f"the replica's response head is larger than "
                                           f"{MAX_HEAD_BYTES} bytes")
                    data = data[room:]  # the body's first bytes (or an interim's next head)
                else:
                    self._head_bytes += len(data)
            self._parser.feed_data(data)
        except Disconnected as exc:
            self._lose(exc)
            self.close()
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            self._lose(Disconnected(f"malformed response from the replica: "
                                    f"{type(exc).__name__}: {exc}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        response = self._response
        if response is not None and response._until_eof and self._head is None:
            response._finish()  # a body delimited by the end of the connection
            return
        self._lose(Disconnected("the replica closed the connection"
                                + (f" ({exc})" if exc else "")))

    # -- httptools callbacks ----------------------------------------------------------

    def on_message_begin(self) -> None:
        if self._ended:  # a second response to one request: never trust this stream again
            self.close()
            raise Disconnected("the replica sent bytes past the end of its response")

    def on_header(self, name: bytes, value: bytes) -> None:
        response = self._response
        assert response is not None
        if response.status == 0:  # trailers after a chunked body are not headers
            response.raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        response = self._response
        assert response is not None
        status = self._parser.get_status_code()
        if 100 <= status < 200:  # an interim response: the real one follows
            response.raw_headers.clear()
            self._head_bytes = 0
            return
        response.status = status
        length = coding = None
        for name, value in response.raw_headers:
            lower = name.lower()
            if lower == b"content-length":
                length = value
            elif lower == b"transfer-encoding":
                coding = value
        chunked = coding is not None and coding.rsplit(b",", 1)[-1].strip().lower() == b"chunked"
        response._until_eof = (status not in (204, 304) and length is None and not chunked)
        # Both framings at once, or a coding that is not chunked: read it, never reuse it.
        doubtful = coding is not None and (length is not None or not chunked)
        response.keep_alive = self._parser.should_keep_alive() and not doubtful
        head, self._head = self._head, None
        if head is not None and not head.done():
            head.set_result(response)

    def on_body(self, body: bytes) -> None:
        assert self._response is not None
        self._response._feed(body)

    def on_message_complete(self) -> None:
        response = self._response
        if response is not None and response.status >= 200:
            self._ended = True
            response._finish()

    # -- used by the pool and the response ------------------------------------------------

    def send(self, head: bytes, body: bytes) -> asyncio.Future[UpstreamResponse]:
        assert self.transport is not None
        self._response = UpstreamResponse(self)
        self._ended = False
        self._head_bytes = 0
        self.answered = False
        self._head = asyncio.get_running_loop().create_future()
        if len(body) < 65536:
            self.transport.write(head + body)  # one segment for the usual small request
        else:
            self.transport.writelines((head, body))
        return self._head

    def head_timed_out(self, after_s: float) -> None:
        head = self._head
        if head is not None and not head.done():
            head.set_exception(TimeoutError(f"no response within {after_s:g} s"))

    def _lose(self, error: BaseException) -> None:
        head, self._head = self._head, None
        if head is not None and not head.done():
            head.set_exception(error)
        if self._response is not None:
            self._response._fail(error)

    def pause(self) -> None:
        if not self._paused and self.transport is not None and not self.closed:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self._paused and self.transport is not None and not self.closed:
            self._paused = False
            self.transport.resume_reading()

    def idle(self) -> None:
        self._response = None  # the parser goes on with the connection's next message
        self.resume()
        self._on_idle(self)

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()
