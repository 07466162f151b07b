"""The router's HTTP front holds clients to limits: slow, large, idle and many.

A real router (the server `dpserve serve` runs) in front of the shared fake
replica, driven by raw sockets: each test plays one abusive client and checks
the connection is closed within the configured limit, with an OpenAI-shaped
error when a request had begun, and that nothing reached the replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import httpx

from tests.conftest import running_router
from tests.fakes import as_sent
from tests.router.rawhttp import completion, exchange, parse_responses, read_all, request
from tests.waiting import wait_for

LIMITS = {"client_header_timeout_s": 1.0, "client_body_timeout_s": 1.0,
          "keep_alive_timeout_s": 1.0, "max_header_bytes": 4096}


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


async def rejections(url: str, reason: str) -> float:
    async with httpx.AsyncClient() as client:
        text = (await client.get(f"{url}/metrics")).text
    line = next(x for x in text.splitlines()
                if x.startswith(f'dpserve_front_rejections_total{{reason="{reason}"}}'))
    return float(line.split()[-1])


async def drip(port: int, data: bytes, every_s: float) -> tuple[bytes, bool, float]:
    """Send `data` a byte at a time; return what came back, whether the server closed
    the connection (within 5 s), and after how long."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    started = time.monotonic()

    async def feed() -> None:
        with contextlib.suppress(ConnectionError):
            for byte in data:
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.sleep(every_s)  # a slow client, on purpose

    feeder = asyncio.create_task(feed())
    try:
        raw, closed = await read_all(reader, quiet_s=None, deadline_s=5)
        return raw, closed, time.monotonic() - started
    finally:
        feeder.cancel()
        writer.close()


async def test_a_slow_header_connection_is_closed_within_the_header_timeout(fake_replicas):
    replica = await fake_replicas("r0")
    async with running_router([replica.url], **LIMITS) as (url, _):
        raw, closed, after_s = await drip(
            port_of(url), b"POST /v1/completions HTTP/1.1\r\nx-slow: " + b"a" * 100, 0.2)
        assert closed and after_s < LIMITS["client_header_timeout_s"] + 1.5
        (answer,) = parse_responses(raw)
        assert answer.status == 408
        assert await rejections(url, "header_timeout") == 1
    assert replica.reached() == []


async def test_an_idle_new_connection_is_closed_without_an_answer(fake_replicas):
    replica = await fake_replicas("r0")
    async with running_router([replica.url], **LIMITS) as (url, _):
        started = time.monotonic()
        raw, closed = await exchange(port_of(url), until_closed=True, deadline_s=5)
        assert closed and raw == b""
        assert time.monotonic() - started < 1.0 + 3.0  # the 1 s limit, not the 5 s deadline


async def test_oversized_headers_get_431_and_never_reach_a_replica(fake_replicas):
    replica = await fake_replicas("r0")
    async with running_router([replica.url], **LIMITS) as (url, _):
        for size in (8 * 1024, 8 * 1024 * 1024):
            raw, closed = await exchange(port_of(url), completion().replace(
                b"host: router\r\n", b"host: router\r\nx-big: " + b"a" * size + b"\r\n"),
                until_closed=True)
            (answer,) = parse_responses(raw)
            assert answer.status == 431
            assert "larger than the limit of 4096 bytes" in answer.error_message
            assert closed
    assert replica.reached() == []


async def test_a_stalled_body_gets_408_and_never_reaches_a_replica(fake_replicas):
    replica = await fake_replicas("r0")
    async with running_router([replica.url], **LIMITS) as (url, _):
        started = time.monotonic()
        raw, closed = await exchange(port_of(url), request(
            "POST", "/v1/completions", "content-length: 100", body=b'{"model": "fake-'),
            until_closed=True, deadline_s=5)
        (answer,) = parse_responses(raw)
        assert answer.status == 408 and closed
        assert time.monotonic() - started < 1.0 + 3.0  # the 1 s limit, not the 5 s deadline
    assert replica.reached() == []


async def test_a_slow_but_steady_body_is_served(fake_replicas):
    replica = await fake_replicas("r0")
    body = json.dumps({"model": "fake-model", "prompt": "steady"}).encode()
    pieces = [body[i:i + 8] for i in range(0, len(body), 8)]
    head = request("POST", "/v1/completions", f"content-length: {len(body)}")
    async with running_router([replica.url], **LIMITS) as (url, _):
        # Each piece within the body timeout, the whole body well past it.
        raw, _ = await exchange(port_of(url), head, *pieces, gap_s=0.3)
        (answer,) = parse_responses(raw)
    assert len(pieces) * 0.3 > LIMITS["client_body_timeout_s"]
    assert answer.status == 200
    assert [as_sent(r) for r in replica.requests] == [{"model": "fake-model", "prompt": "steady"}]


async def test_connections_past_the_cap_get_503_at_once(fake_replicas):
    replica = await fake_replicas("r0")
    async with running_router([replica.url], **LIMITS, max_connections=3) as (url, _):
        held = [await asyncio.open_connection("127.0.0.1", port_of(url)) for _ in range(3)]
        try:
            raw, closed = await exchange(port_of(url), completion(), until_closed=True)
            (answer,) = parse_responses(raw)
            assert answer.status == 503 and closed
            assert answer.headers["retry-after"] == "1"
        finally:
            for _, writer in held:
                writer.close()
        # Once they are gone, a new client is served again.
        async with httpx.AsyncClient() as client:
            async def served() -> bool:
                resp = await client.post(f"{url}/v1/completions",
                                         json={"model": "fake-model", "prompt": "x"})
                return resp.status_code == 200

            await wait_for(served, "a new client to be served", within_s=5, every_s=0.05)


async def test_at_the_cap_a_connection_idle_between_requests_makes_room(fake_replicas):
    """Three connections open, one of them idle after its request: a fourth client is
    served, and the idle one is closed (nothing was in flight on it)."""
    replica = await fake_replicas("r0")
    limits = {**LIMITS, "keep_alive_timeout_s": 30.0, "client_header_timeout_s": 30.0}
    async with running_router([replica.url], **limits, max_connections=3) as (url, _):
        port = port_of(url)
        idle_reader, idle_writer = await asyncio.open_connection("127.0.0.1", port)
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
        try:
            idle_writer.write(completion())
            assert b" 200 " in await idle_reader.readuntil(b"\r\n")
            raw, _ = await exchange(port, completion("new"))
            assert [a.status for a in parse_responses(raw)] == [200]
            _, closed = await read_all(idle_reader, quiet_s=None, deadline_s=5)
            assert closed
            assert await rejections(url, "idle_reclaimed") == 1
            # (with none idle, the cap answers 503: the test above)
        finally:
            for _, writer in (*held, (idle_reader, idle_writer)):
                writer.close()


async def test_an_idle_keep_alive_connection_is_closed_after_the_keep_alive_timeout(
        fake_replicas):
    replica = await fake_replicas("r0")
    async with running_router([replica.url], **LIMITS) as (url, _):
        started = time.monotonic()
        raw, closed = await exchange(port_of(url), completion(), until_closed=True,
                                     deadline_s=5)
        assert [a.status for a in parse_responses(raw)] == [200]
        assert closed and time.monotonic() - started < 1.0 + 3.0  # the limit, not the deadline


async def test_a_malformed_request_gets_400_in_the_openai_envelope(fake_replicas):
    replica = await fake_replicas("r0")
    async with running_router([replica.url], **LIMITS) as (url, _):
        raw, closed = await exchange(port_of(url), b"GARBAGE\x01 / HTTP/9.9\r\n\r\n",
                                     until_closed=True)
        (answer,) = parse_responses(raw)
        assert answer.status == 400 and closed
        assert answer.json()["error"]["type"] == "BadRequestError"
        assert await rejections(url, "malformed") == 1


async def test_a_protocol_upgrade_is_refused(fake_replicas):
    replica = await fake_replicas("r0")
    async with running_router([replica.url], **LIMITS) as (url, _):
        raw, closed = await exchange(port_of(url), request(
            "GET", "/v1/models", "connection: upgrade", "upgrade: websocket"), until_closed=True)
        (answer,) = parse_responses(raw)
        assert answer.status == 400 and closed
