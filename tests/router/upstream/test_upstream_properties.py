"""Property-based tests of the data plane's response parsing (`dpserve.router.upstream.client`).

A connection is driven without a network: the response's bytes are fed in random
pieces, as TCP may deliver them, and each property says what a client of the
router would notice: the status and body are exactly what the replica sent, a
connection goes back to the pool only when the response ended by its own framing
with keep-alive, and bytes past the end of a response (what a smuggled request
would produce) or a malformed response never leave a connection reusable.
"""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dpserve.router.upstream.client import (
    Disconnected,
    Origin,
    UpstreamPool,
    UpstreamResponse,
)
from dpserve.router.upstream.connection import Connection

ORIGIN = Origin.parse("http://replica:8000")
SETTINGS = settings(max_examples=300, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


class FakeTransport:
    """Stands in for the socket: records writes and whether it was closed."""

    def __init__(self) -> None:
        self.closed = False

    def write(self, data: bytes) -> None:
        pass

    def writelines(self, data: list[bytes]) -> None:
        pass

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


@dataclass
class Outcome:
    status: int | None
    body: bytes | None
    error: BaseException | None
    reusable: bool


def feed(raw: bytes, cuts: list[int], *, eof: bool, release_early: bool = False) -> Outcome:
    """Feed `raw` cut at `cuts`; end with the connection closing if `eof`. Release the
    response as soon as it is complete if `release_early` (the proxy's usual timing)."""

    async def run() -> Outcome:
        pool = UpstreamPool()
        conn = Connection(functools.partial(pool._put, ORIGIN))
        transport = FakeTransport()
        conn.connection_made(transport)  # type: ignore[arg-type]
        head = conn.send(b"POST /v1/completions HTTP/1.1\r\n\r\n", b"")
        pieces = [raw[a:b] for a, b in zip([0, *cuts], [*cuts, len(raw)], strict=True) if b > a]
        response: UpstreamResponse | None = None
        body = bytearray()
        released = False
        for piece in pieces:
            if transport.closed:
                break
            conn.data_received(piece)
            if response is None and head.done() and head.exception() is None:
                response = head.result()
            if response is not None:
                body += response.body_so_far()
                if release_early and response.complete and not released:
                    response.release()
                    released = True
        if eof and not transport.closed:
            conn.connection_lost(None)
        if not head.done():
            return Outcome(None, None, None, reusable=False)
        if head.exception() is not None:
            return Outcome(None, None, head.exception(), reusable=False)
        response = head.result()
        error = None
        try:
            body += await asyncio.wait_for(response.read(), 1)
        except (Disconnected, TimeoutError) as exc:
            error = exc
        if not released:
            response.release()
        reusable = pool._reusable(ORIGIN) is conn
        pool.close()
        return Outcome(response.status, bytes(body), error, reusable)

    return asyncio.run(run())


# -- strategies -----------------------------------------------------------------------

TOKEN = st.text("abcdefghijklmnopqrstuvwxyz-", min_size=1, max_size=12).filter(
    lambda n: n not in ("content-length", "transfer-encoding", "connection", "upgrade",
                        "keep-alive") and not n.startswith("-"))
VALUE = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=30)
HEADERS = st.lists(st.tuples(TOKEN, VALUE), max_size=5)


@st.composite
def responses(draw: st.DrawFn) -> tuple[bytes, int, bytes, str, bool]:
    """(raw bytes, status, body, framing, keep-alive announced)."""
    framing = draw(st.sampled_from(["length", "chunked", "close", "bodiless"]))
    status = draw(st.sampled_from([204, 304]) if framing == "bodiless"
                  else st.sampled_from([200, 201, 400, 404, 422, 500, 503]))
    body = b"" if framing == "bodiless" else draw(st.binary(max_size=3000))
    close = framing == "close" or draw(st.booleans())
    interim = draw(st.lists(st.sampled_from([100, 102, 103]), max_size=2))
    raw = b"".join(b"HTTP/1.1 %d Interim\r\n\r\n" % code for code in interim)
    head = [b"HTTP/1.1 %d Whatever\r\n" % status]
    head += [f"{n}: {v}\r\n".encode() for n, v in draw(HEADERS)]
    if close:
        head.append(b"connection: close\r\n")
    if framing == "length":
        head.append(b"content-length: %d\r\n" % len(body))
        payload = body
    elif framing == "chunked":
        head.append(b"transfer-encoding: chunked\r\n")
        sizes = draw(st.lists(st.integers(1, 700), max_size=8))
        pieces, at = [], 0
        for size in sizes:
            if at >= len(body):
                break
            pieces.append(body[at:at + size])
            at += size
        if at < len(body):
            pieces.append(body[at:])
        ext = b";ext=1" if draw(st.booleans()) else b""
        trailers = b"x-trailer: t\r\n" if draw(st.booleans()) else b""
        payload = b"".join(b"%x%s\r\n%s\r\n" % (len(p), ext, p) for p in pieces)
        payload += b"0\r\n" + trailers + b"\r\n"
    else:
        payload = body
    raw += b"".join(head) + b"\r\n" + payload
    return raw, status, body, framing, not close


def cuts_of(raw: bytes) -> st.SearchStrategy[list[int]]:
    return st.lists(st.integers(0, len(raw)), max_size=12).map(lambda c: sorted(set(c)))


EXTRA = st.sampled_from([
    b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\nATTACKER!",
    b"HTTP/1.1 204 No Content\r\n\r\n",
    b"garbage",
    b"H",
])


# -- properties -----------------------------------------------------------------------

@SETTINGS
@given(st.data())
def test_any_valid_response_in_any_pieces_arrives_exactly(data):
    raw, status, body, framing, keep_alive = data.draw(responses())
    cuts = data.draw(cuts_of(raw))
    got = feed(raw, cuts, eof=framing == "close")
    assert got.error is None
    assert (got.status, got.body) == (status, body)
    # Reused only when framed by itself, with keep-alive; close-delimited never.
    assert got.reusable == (keep_alive and framing != "close")


@SETTINGS
@given(st.data())
def test_bytes_past_the_end_of_a_response_never_leave_the_connection_reusable(data):
    raw, status, body, _, _ = data.draw(responses().filter(lambda r: r[3] != "close"))
    extra = data.draw(EXTRA)
    whole = raw + extra
    cuts = data.draw(cuts_of(whole))
    got = feed(whole, cuts, eof=False, release_early=data.draw(st.booleans()))
    assert (got.status, got.body) == (status, body)  # the extra bytes are nobody's body
    assert not got.reusable


BROKEN = st.sampled_from([
    b"HTTP/1.1 200 OK\r\ncontent-length: -1\r\n\r\n",
    b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\ncontent-length: 6\r\n\r\nhello!",
    b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-length: 5\r\n\r\n"
    b"5\r\nhello\r\n0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n\r\nhello",
    b"HTTP/1.1 101 Switching Protocols\r\nupgrade: h2c\r\nconnection: upgrade\r\n\r\nxx",
    b"HTTP/1.1 200 OK\r\nx-big: " + b"a" * (70 * 1024) + b"\r\ncontent-length: 0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nshort",
    b"NOT HTTP AT ALL\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nbad header\r\n\r\n",
])


@SETTINGS
@given(st.data())
def test_a_malformed_or_doubtful_response_never_leaves_the_connection_reusable(data):
    raw = data.draw(BROKEN)
    got = feed(raw, data.draw(cuts_of(raw)), eof=data.draw(st.booleans()))
    assert not got.reusable


@SETTINGS
@given(st.binary(max_size=400), st.data())
def test_arbitrary_bytes_never_crash_the_parser(raw, data):
    got = feed(raw, data.draw(cuts_of(raw)), eof=data.draw(st.booleans()))
    assert got.error is None or isinstance(got.error, Disconnected | TimeoutError)
