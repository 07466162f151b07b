"""A response's head and first body part go out in one write, and the bytes are uvicorn's.

The router's front (`GuardedProtocol`) and uvicorn's own httptools protocol are fed the
same request bytes, and their ASGI app sends the same response messages; each writes
into a recording transport. Whatever the response (status, framing, body split into
parts, the app yielding to the event loop between messages, HEAD, `connection: close`,
pipelined requests, a header name or value uvicorn refuses), the bytes written must be
identical, and the front must have written the head with the first body part unless
the app yielded in between.

(An app that sends a head and returns without a body gets its connection closed with
nothing written here, where uvicorn writes the head first; either way the client sees
a broken response. The router's endpoints always send a body.)
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import uvicorn
from hypothesis import given, settings
from hypothesis import strategies as st
from uvicorn.protocols.http.httptools_impl import HEADER_RE, HEADER_VALUE_RE, HttpToolsProtocol
from uvicorn.server import ServerState

from dpserve.router.http.front import FrontLimits, GuardedProtocol

LIMITS = FrontLimits(max_header_bytes=64 * 1024, header_timeout_s=30.0, body_timeout_s=30.0,
                     max_connections=100)


class RecordingTransport(asyncio.Transport):
    """A transport that keeps each write apart, to count them."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: Any) -> None:
        assert not self.closed, "a write after close"
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 40000)}.get(
            name, default)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        pass


@dataclass(frozen=True)
class Reply:
    status: int
    parts: tuple[bytes, ...]
    framing: str  # "length" or "chunked" (no content-length: the server chunks it)
    yields: tuple[bool, ...]  # before each body part: does the app yield to the loop?
    extra: tuple[bytes, bytes] = (b"x-request-id", b"abc")

    @property
    def valid_head(self) -> bool:
        return HEADER_RE.search(self.extra[0]) is None and \
            HEADER_VALUE_RE.search(self.extra[1]) is None

    def messages(self) -> list[dict[str, Any]]:
        headers = [(b"content-type", b"application/json"), self.extra]
        if self.framing == "length":
            headers.append((b"content-length", str(sum(map(len, self.parts))).encode()))
        out: list[dict[str, Any]] = [
            {"type": "http.response.start", "status": self.status, "headers": headers}]
        for i, part in enumerate(self.parts):
            out.append({"type": "http.response.body", "body": part,
                        "more_body": i < len(self.parts) - 1})
        return out


def make_app(reply: Reply):
    async def app(scope, receive, send) -> None:
        more = True
        while more:
            more = (await receive()).get("more_body", False)
        start, *bodies = reply.messages()
        await send(start)
        for message, yields in zip(bodies, reply.yields, strict=True):
            if yields:  # a stream waiting for its replica: the head must not wait with it
                for _ in range(3):
                    await asyncio.sleep(0)
            await send(message)

    return app


def serve(protocol_class: Any, app: Any, data: bytes, responses: int) -> RecordingTransport:
    """Feed `data` to a fresh connection of `protocol_class`; run until `responses`
    responses completed (or the connection closed)."""

    async def run() -> RecordingTransport:
        config = uvicorn.Config(app, lifespan="off", access_log=False, log_level="error")
        config.load()
        state = ServerState()
        done = 0
        kwargs = {"limits": LIMITS} if protocol_class is GuardedProtocol else {}
        protocol = protocol_class(config=config, server_state=state, app_state={}, **kwargs)
        transport = RecordingTransport()

        def counted() -> None:
            nonlocal done
            done += 1
            on_complete()

        on_complete = protocol.on_response_complete
        protocol.on_response_complete = counted
        protocol.connection_made(transport)
        protocol.data_received(data)
        for _ in range(2000):
            if done >= responses or transport.closed:
                break
            await asyncio.sleep(0)
        for _ in range(5):  # a head flush still due, tasks ending
            await asyncio.sleep(0)
        protocol.connection_lost(None)
        return transport

    return asyncio.run(run())


def request(method: str, *, close: bool = False) -> bytes:
    body = b"" if method in ("GET", "HEAD") else b'{"prompt": "hi"}'
    head = f"{method} /v1/completions HTTP/1.1\r\nhost: router\r\n"
    if body:
        head += f"content-length: {len(body)}\r\ncontent-type: application/json\r\n"
    if close:
        head += "connection: close\r\n"
    return head.encode() + b"\r\n" + body


header_bytes = st.binary(min_size=1, max_size=6).filter(lambda b: b.lower() not in (
    b"content-length", b"transfer-encoding", b"connection"))
replies = st.builds(
    lambda status, parts, framing, yields, extra: Reply(
        status, (b"",) if status == 204 else tuple(parts) or (b"",), framing,
        tuple(yields[: max(1, len(parts))]), extra),
    st.sampled_from([200, 200, 400, 503, 204]),
    st.lists(st.binary(min_size=0, max_size=40), min_size=0, max_size=4),
    st.sampled_from(["length", "chunked"]),
    st.lists(st.booleans(), min_size=4, max_size=4),
    st.one_of(st.just((b"x-request-id", b"abc")), st.tuples(header_bytes, header_bytes)),
)


@settings(max_examples=300, deadline=None)
@given(reply=replies, method=st.sampled_from(["POST", "GET", "HEAD"]), close=st.booleans(),
       pipelined=st.booleans())
def test_the_front_writes_uvicorns_bytes_with_the_head_joined_to_the_first_body(
        reply, method, close, pipelined):
    data = request(method, close=close and not pipelined)
    responses = 1
    if pipelined:  # a second request in the same segment, answered after the first
        data += request(method, close=close)
        responses = 2
    app = make_app(reply)
    ours = serve(GuardedProtocol, app, data, responses)
    theirs = serve(HttpToolsProtocol, app, data, responses)
    assert b"".join(ours.writes) == b"".join(theirs.writes)
    assert ours.closed == theirs.closed
    if not reply.valid_head:  # refused before a byte: both close the connection
        assert ours.writes == [] and ours.closed
        return
    ours_n, theirs_n = (len([w for w in t.writes if w]) for t in (ours, theirs))
    if reply.yields[0] or not first_part_is_written(reply, method):
        assert ours_n == theirs_n  # the head went out alone: the app waited, or no bytes
        return
    # Per response: uvicorn writes the head and then each body part; we join the first.
    assert ours_n == theirs_n - responses


def first_part_is_written(reply: Reply, method: str) -> bool:
    """Does uvicorn write bytes for the first body part (HEAD and empty parts write none;
    the chunked framing's last part writes its terminator)?"""
    if method == "HEAD":
        return False
    if reply.framing == "chunked" and reply.status != 204:
        return bool(reply.parts[0]) or len(reply.parts) == 1
    return bool(reply.parts[0])


def test_a_stream_gets_its_head_before_its_first_event():
    """A streamed reply whose first event is late (a replica still prefilling) must not
    keep the client waiting for the status line."""
    first_event = asyncio.Event()
    seen: list[int] = []

    async def app(scope, receive, send) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        await first_event.wait()
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": False})

    async def run() -> list[bytes]:
        config = uvicorn.Config(app, lifespan="off", access_log=False, log_level="error")
        config.load()
        protocol = GuardedProtocol(config=config, server_state=ServerState(), app_state={},
                                   limits=LIMITS)
        transport = RecordingTransport()
        protocol.connection_made(transport)
        protocol.data_received(request("POST"))
        for _ in range(10):
            await asyncio.sleep(0)
        seen.append(len(transport.writes))
        assert transport.writes and transport.writes[0].startswith(b"HTTP/1.1 200 OK\r\n")
        assert b"data: 1" not in transport.writes[0]
        first_event.set()
        for _ in range(10):
            await asyncio.sleep(0)
        protocol.connection_lost(None)
        return transport.writes

    writes = asyncio.run(run())
    assert seen == [1]
    assert writes[-1].endswith(b"0\r\n\r\n")


def test_a_held_head_is_not_written_once_the_client_left():
    """The client goes away between the head and the moment it would be flushed."""
    holder: dict[str, Any] = {}

    async def app(scope, receive, send) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        holder["transport"].closed = True
        holder["protocol"].connection_lost(ConnectionResetError())
        await asyncio.sleep(0)
        await send({"type": "http.response.body", "body": b"late", "more_body": False})

    async def run() -> RecordingTransport:
        config = uvicorn.Config(app, lifespan="off", access_log=False, log_level="error")
        config.load()
        protocol = GuardedProtocol(config=config, server_state=ServerState(), app_state={},
                                   limits=LIMITS)
        transport = RecordingTransport()
        holder.update(transport=transport, protocol=protocol)
        protocol.connection_made(transport)
        protocol.data_received(request("POST"))
        for _ in range(10):
            await asyncio.sleep(0)
        return transport

    assert asyncio.run(run()).writes == []


async def test_a_body_answered_before_it_was_read_is_not_kept():
    """A refusal (401, 404, 413) goes out before its body is read: what uvicorn buffered
    of that body is dropped once the answer is complete, not held by the connection
    until the client ends the body (one byte every 30 s) or closes it."""
    async def refuse(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"no"})

    config = uvicorn.Config(refuse, lifespan="off", access_log=False, log_level="error")
    config.load()
    protocol = GuardedProtocol(config=config, server_state=ServerState(), app_state={},
                               limits=LIMITS)
    transport = RecordingTransport()
    protocol.connection_made(transport)
    protocol.data_received(b"POST /v1/completions HTTP/1.1\r\nhost: r\r\n"
                           b"content-length: 1048576\r\n\r\n" + b"x" * 200_000)
    cycle = protocol.cycle
    assert cycle is not None and len(cycle.body) == 200_000  # buffered, unread
    for _ in range(100):
        if cycle.response_complete:
            break
        await asyncio.sleep(0)
    assert cycle.response_complete and b"401" in b"".join(transport.writes)
    assert len(cycle.body) == 0
    protocol.data_received(b"x" * 100_000)  # what comes after is dropped as it comes
    assert len(cycle.body) == 0
    protocol.connection_lost(None)
