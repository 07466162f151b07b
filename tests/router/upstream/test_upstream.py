"""The data plane's HTTP/1.1 client against scripted raw-socket servers.

Each server is a plain asyncio TCP server whose handler writes exactly the bytes
a test needs (keep-alive, chunked, cut mid-body, silent), so every path of the
client is shown on the wire rather than through another HTTP library.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from dpserve.replicas.launcher import free_port
from dpserve.router.fleet.breaker import Outcome, classify
from dpserve.router.upstream.client import (
    ConnectFailed,
    ConnectTimeout,
    Disconnected,
    Origin,
    UpstreamPool,
)
from tests.waiting import wait_for

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
HEAD = b"POST /v1/completions HTTP/1.1\r\nhost: r\r\ncontent-length: 2\r\n\r\n"


@contextlib.asynccontextmanager
async def server(handler: Handler) -> AsyncIterator[tuple[Origin, list[int]]]:
    """A TCP server on loopback; yields its origin and a list counting connections."""
    connections: list[int] = []

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        try:
            await handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    srv = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        yield Origin.parse(f"http://127.0.0.1:{port}"), connections
    finally:
        srv.close()


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    return head + await reader.readexactly(length)


def ok(body: bytes, *extra: bytes) -> bytes:
    return (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n%s"
            % (len(body), b"".join(h + b"\r\n" for h in extra), body))


def answers_once(raw: bytes) -> Handler:
    """A handler that reads one request, writes `raw`, and closes the connection."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(raw)
        await writer.drain()

    return handler


async def send(pool: UpstreamPool, origin: Origin, head_timeout_s: float = 5.0):
    return await pool.request(origin, HEAD, b"{}", connect_timeout_s=5.0,
                              head_timeout_s=head_timeout_s)


async def test_keep_alive_connections_are_reused_for_sequential_requests():
    async def handler(reader, writer):
        while True:
            await read_request(reader)
            writer.write(ok(b'{"n": 1}'))

    pool = UpstreamPool()
    async with server(handler) as (origin, connections):
        for _ in range(3):
            resp = await send(pool, origin)
            assert (resp.status, await resp.read()) == (200, b'{"n": 1}')
            assert resp.content_type == "application/json"
            resp.release()
        assert len(connections) == 1
    pool.close()


async def test_the_request_goes_out_as_written_with_its_body():
    seen: list[bytes] = []

    async def handler(reader, writer):
        seen.append(await read_request(reader))
        writer.write(ok(b"{}"))

    pool = UpstreamPool()
    async with server(handler) as (origin, _):
        resp = await send(pool, origin)
        await resp.read()
        resp.release()
    assert seen == [HEAD + b"{}"]
    pool.close()


async def test_a_chunked_stream_arrives_chunk_by_chunk_before_it_ends():
    release = asyncio.Event()

    async def handler(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\n\r\n")
        writer.write(b"8\r\ndata: 1\n\r\n")
        await writer.drain()
        await release.wait()
        writer.write(b"8\r\ndata: 2\n\r\n0\r\n\r\n")

    pool = UpstreamPool()
    async with server(handler) as (origin, _):
        resp = await send(pool, origin)
        assert resp.content_type == "text/event-stream"
        assert await resp.readany() == b"data: 1\n"  # while the server still holds the rest
        release.set()
        rest = b""
        while chunk := await resp.readany():
            rest += chunk
        assert rest == b"data: 2\n" and resp.complete
        resp.release()
    pool.close()


async def test_a_body_without_length_ends_with_the_connection():
    pool = UpstreamPool()
    reply = b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nall of it"
    async with server(answers_once(reply)) as (origin, _):
        resp = await send(pool, origin)
        assert await resp.read() == b"all of it"
        resp.release()
    pool.close()


async def test_a_connection_cut_mid_body_is_a_disconnect_not_a_short_body():
    pool = UpstreamPool()
    reply = b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly part"
    async with server(answers_once(reply)) as (origin, _):
        resp = await send(pool, origin)
        with pytest.raises(Disconnected) as caught:
            await resp.read()
        assert classify(None, caught.value) is Outcome.DISCONNECTED
        resp.release()
    pool.close()


async def test_a_closed_port_is_a_connect_failure_that_sent_nothing():
    pool = UpstreamPool()
    with pytest.raises(ConnectFailed) as caught:
        await send(pool, Origin.parse(f"http://127.0.0.1:{free_port()}"))
    assert classify(None, caught.value) is Outcome.CONNECT_FAILED
    assert classify(None, ConnectTimeout("slow accept")) is Outcome.CONNECT_TIMEOUT
    pool.close()


async def test_no_response_head_in_time_is_a_timeout_and_the_connection_is_dropped():
    gone = asyncio.Event()

    async def handler(reader, writer):
        await read_request(reader)
        await reader.read()  # returns at EOF: the client gave up on this connection
        gone.set()

    pool = UpstreamPool()
    async with server(handler) as (origin, _):
        with pytest.raises(TimeoutError) as caught:
            await send(pool, origin, head_timeout_s=0.2)
        assert classify(None, caught.value) is Outcome.TIMEOUT
        await asyncio.wait_for(gone.wait(), 5)
    pool.close()


async def test_releasing_an_unread_response_closes_its_connection():
    gone = asyncio.Event()

    async def handler(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await writer.drain()
        await reader.read()  # EOF once the client closed: what makes vLLM abort
        gone.set()

    pool = UpstreamPool()
    async with server(handler) as (origin, connections):
        resp = await send(pool, origin)
        assert await resp.readany() == b"first"
        resp.release()
        await asyncio.wait_for(gone.wait(), 5)
        again = await send(pool, origin)  # a new connection, not the abandoned one
        assert len(connections) == 2
        again.release()
    pool.close()


async def test_open_releases_the_response_when_its_block_is_left():
    """Read to its end: the connection carries the next request. Left unread (or left
    by an exception): the connection is closed, as a replica must see to abort."""
    gone = asyncio.Event()

    async def handler(reader, writer):
        await read_request(reader)
        writer.write(ok(b'{"n": 1}'))
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await writer.drain()
        await reader.read()
        gone.set()

    pool = UpstreamPool()
    async with server(handler) as (origin, connections):
        target, headers = b"POST /v1/completions", b"content-length: 2\r\n\r\n"
        async with pool.open(origin, target, headers, b"{}", connect_timeout_s=5,
                             head_timeout_s=5) as resp:
            assert await resp.read() == b'{"n": 1}'
        with pytest.raises(RuntimeError):
            async with pool.open(origin, target, headers, b"{}", connect_timeout_s=5,
                                 head_timeout_s=5) as resp:
                assert await resp.readany() == b"first"
                raise RuntimeError("the caller failed mid-body")
        await asyncio.wait_for(gone.wait(), 5)
        assert len(connections) == 1  # the second request went out on the first's connection
    pool.close()


async def test_a_connection_the_server_closed_while_idle_is_not_reused():
    pool = UpstreamPool()
    async with server(answers_once(ok(b"{}"))) as (origin, connections):
        first = await send(pool, origin)
        await first.read()
        first.release()
        await wait_for(lambda: all(c.closed for idle in pool._idle.values() for c in idle),
                       "the server's close to be noticed")
        second = await send(pool, origin)
        assert (second.status, await second.read()) == (200, b"{}")
        second.release()
        assert len(connections) == 2
    pool.close()


async def test_a_malformed_response_is_a_disconnect():
    pool = UpstreamPool()
    async with server(answers_once(b"NOT HTTP AT ALL\r\n\r\n")) as (origin, _):
        with pytest.raises(Disconnected):
            await send(pool, origin)
    pool.close()


def test_origins_parse_host_port_and_scheme():
    assert Origin.parse("http://127.0.0.1:8001") == Origin("127.0.0.1", 8001, False,
                                                           b"127.0.0.1:8001")
    assert Origin.parse("https://engine-0.svc").port == 443
    with pytest.raises(ValueError, match="not an http"):
        Origin.parse("ftp://x")


def closes_its_second_request_unanswered(answered: bytes = b"") -> Handler:
    """Answers one request, keeps the connection, then closes it when the next request
    arrives, writing `answered` first: what a replica does whose keep-alive timer fires
    as the request comes in (nothing), or one that dies mid-answer (some bytes)."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(ok(b"{}"))
        await writer.drain()
        await read_request(reader)
        writer.write(answered)
        await writer.drain()

    return handler


async def test_a_kept_alive_connection_closed_unanswered_is_tried_once_more_on_a_new_one():
    pool = UpstreamPool()
    async with server(closes_its_second_request_unanswered()) as (origin, connections):
        first = await send(pool, origin)
        await first.read()
        first.release()
        second = await send(pool, origin)  # the same connection, closed by the server
        assert (second.status, await second.read()) == (200, b"{}")
        second.release()
        assert len(connections) == 2 and pool.stale_retries == 1
    pool.close()


async def test_a_kept_alive_connection_closed_mid_answer_is_a_disconnect_not_a_retry():
    pool = UpstreamPool()
    async with server(closes_its_second_request_unanswered(b"HTTP/1.1 200 OK\r\n")) as (
            origin, connections):
        first = await send(pool, origin)
        await first.read()
        first.release()
        with pytest.raises(Disconnected):
            await send(pool, origin)  # it answered something: the request may have run
        assert len(connections) == 1 and pool.stale_retries == 0
    pool.close()


async def test_a_new_connection_closed_unanswered_is_a_disconnect_and_retried_no_more():
    async def closes(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)

    pool = UpstreamPool()
    async with server(closes) as (origin, connections):
        with pytest.raises(Disconnected):
            await send(pool, origin)
        assert len(connections) == 1 and pool.stale_retries == 0
    pool.close()


UVICORN_KEEP_ALIVE_S = 5  # vLLM's (VLLM_HTTP_TIMEOUT_KEEP_ALIVE)
SERVER = f"""
import sys, uvicorn
async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send({{"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", b"2")]}})
    await send({{"type": "http.response.body", "body": b"ok"}})
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), loop="uvloop", http="httptools",
            timeout_keep_alive={UVICORN_KEEP_ALIVE_S}, log_level="warning")
"""


async def test_a_request_sent_to_a_stalled_uvicorn_is_answered_when_it_wakes(tmp_path):
    """uvicorn on uvloop, as vLLM serves: stopped (SIGSTOP) 2 s into a connection's idle
    time, sent a request on that connection 1 s later (3 s idle: reusable), continued
    past its 5 s keep-alive. On waking it runs the due keep-alive timer first and closes
    the connection, request unread: before the retry this was a reset request and a
    failure counted against the replica."""
    import signal
    import sys

    import httpx

    port = free_port()
    (tmp_path / "server.py").write_text(SERVER)
    proc = await asyncio.create_subprocess_exec(sys.executable, str(tmp_path / "server.py"),
                                                str(port))
    pool = UpstreamPool()
    try:
        async def up() -> bool:
            try:
                async with httpx.AsyncClient() as c:
                    return (await c.get(f"http://127.0.0.1:{port}/")).status_code == 200
            except httpx.HTTPError:
                return False

        await wait_for(up, "uvicorn to listen", within_s=30)
        origin = Origin.parse(f"http://127.0.0.1:{port}")
        first = await send(pool, origin)
        await first.read()
        first.release()
        await asyncio.sleep(2.0)
        proc.send_signal(signal.SIGSTOP)
        await asyncio.sleep(1.0)
        sent = asyncio.create_task(send(pool, origin, head_timeout_s=30))
        await asyncio.sleep(UVICORN_KEEP_ALIVE_S - 3 + 0.5)
        proc.send_signal(signal.SIGCONT)
        answer = await sent
        assert (answer.status, await answer.read()) == (200, b"ok")
        answer.release()
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.terminate()
        await asyncio.wait_for(proc.wait(), 10)
        pool.close()
