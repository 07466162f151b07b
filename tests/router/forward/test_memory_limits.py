"""What the router holds in memory is bounded, and bad input is a 4xx, never a 500.

Each request body is read whole before it is forwarded, and a non-streamed
response is read whole before it is passed on; these tests check the bounds on
both, and that a body built to exhaust the JSON parser is refused cleanly.
"""

from __future__ import annotations

import asyncio
import json

import httpx

from tests.conftest import running_router
from tests.router.rawhttp import exchange, parse_responses, read_all, request


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


async def test_request_bytes_held_at_once_are_bounded_with_503_and_retry_after(fake_replicas):
    replica = await fake_replicas("r0")
    body = json.dumps({"model": "fake-model", "prompt": "x" * 1400}).encode()
    settings = {"max_body_bytes": 2048, "max_inflight_body_bytes": 2048}
    async with running_router([replica.url], **settings) as (url, _):
        # One client declares a large body and sends only half of it: held, not done.
        reader, writer = await asyncio.open_connection("127.0.0.1", port_of(url))
        head = request("POST", "/v1/completions", f"content-length: {len(body)}")
        writer.write(head + body[:700])
        await writer.drain()
        raw, _ = await exchange(port_of(url), request("POST", "/v1/completions", body=body))
        (refused,) = parse_responses(raw)
        # The first one finishes; its bytes are given back, and the next one is served.
        writer.write(body[700:])
        await writer.drain()
        first, _ = await read_all(reader, quiet_s=1.0, deadline_s=10)
        writer.close()
        raw, _ = await exchange(port_of(url), request("POST", "/v1/completions", body=body))
        (served,) = parse_responses(raw)
    assert refused.status == 503
    assert refused.headers["retry-after"] == "1"
    assert "max_inflight_body_bytes" in refused.error_message
    assert [r.status for r in parse_responses(first)] == [200]
    assert served.status == 200


async def test_a_replica_response_larger_than_the_cap_is_a_502():
    big = json.dumps({"choices": [{"text": "y" * 4096}]}).encode()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                payload = (b'{"object": "list", "data": [{"id": "fake-model"}]}'
                           if head.startswith(b"GET ") else big)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\n\r\n%s" % (len(payload), payload))
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    upstream = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        async with (running_router([upstream], max_response_bytes=2048) as (url, _),
                    httpx.AsyncClient() as client):
            resp = await client.post(f"{url}/v1/completions",
                                     json={"model": "fake-model", "prompt": "x"})
    finally:
        server.close()
    assert resp.status_code == 502
    assert "larger than the router's limit of 2048 bytes" in resp.json()["error"]["message"]


async def test_deeply_nested_json_is_a_400_without_a_traceback(fake_replicas, caplog):
    replica = await fake_replicas("r0")
    async with running_router([replica.url]) as (url, _), httpx.AsyncClient() as client:
        resp = await client.post(f"{url}/v1/completions", content=b"[" * 100_000,
                                 headers={"content-type": "application/json"})
    assert resp.status_code == 400
    assert resp.json()["error"]["message"] == "request body is nested too deeply"
    assert "Traceback" not in caplog.text
    assert replica.reached() == []


async def test_a_streamed_event_larger_than_the_cap_ends_the_stream_after_whole_events():
    """The router holds an unfinished event (never half an event to the client); one that
    grows past max_response_bytes without its end is not held further: the client gets
    the whole events before it, the router's error event and [DONE], and the replica's
    connection is closed."""
    closed = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                if head.startswith(b"GET "):
                    payload = b'{"object": "list", "data": [{"id": "fake-model"}]}'
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                                 b"content-length: %d\r\n\r\n%s" % (len(payload), payload))
                    continue
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"transfer-encoding: chunked\r\n\r\n")
                for piece in (b'data: {"n": 1}\n\n', b'data: {"n": 2, "text": "' + b"y" * 4096):
                    writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                await writer.drain()
                await reader.read()  # hold the stream open until the router closes it
                closed.set()
                return
        except (asyncio.IncompleteReadError, ConnectionError):
            closed.set()
            writer.close()

    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    upstream = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    body = json.dumps({"model": "fake-model", "prompt": "x", "stream": True}).encode()
    try:
        async with running_router([upstream], max_response_bytes=2048) as (url, _):
            raw, _ = await exchange(port_of(url), request("POST", "/v1/completions", body=body),
                                    quiet_s=2.0)
            await asyncio.wait_for(closed.wait(), 10)
    finally:
        server.close()
    (resp,) = parse_responses(raw)
    assert resp.status == 200
    events = [e for e in resp.body.decode().split("\n\n") if e]
    assert events[0] == 'data: {"n": 1}'
    assert "over 2048 bytes" in json.loads(events[1].removeprefix("data: "))["error"]["message"]
    assert events[2:] == ["data: [DONE]"]
