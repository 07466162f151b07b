"""Request smuggling through the router, tried on the socket as an attacker would.

Behind the router sit vLLM's dev endpoints (`/collective_rpc` runs any worker
method, `/sleep` stops serving), so no byte the router does not frame itself may
reach a replica. Each test sends raw bytes to a real router in front of the
shared fake replica (it logs every request that reaches it) and checks what the
client got back and what the replica saw.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from dpserve.router.forward.assembled import ride_body
from tests.conftest import running_router
from tests.fakes import as_sent
from tests.router.rawhttp import completion, exchange, parse_responses, request

SMUGGLED = (b"POST /collective_rpc HTTP/1.1\r\nhost: r\r\ncontent-type: application/json\r\n"
            b"content-length: 68\r\n\r\n"
            b'{"method": "reload_weights", "kwargs": {"weights_path": "/tmp/evil"}}')
SLEEP = b"POST /sleep?level=1 HTTP/1.1\r\nhost: r\r\ncontent-length: 0\r\n\r\n"


def chunked(body: bytes) -> bytes:
    return b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


async def test_a_body_on_get_models_is_refused_and_never_reaches_a_replica(fake_replicas):
    replica = await fake_replicas("r0")
    async with running_router([replica.url]) as (url, _):
        raw, _ = await exchange(port_of(url), request(
            "GET", "/v1/models", f"content-length: {len(SMUGGLED)}", body=SMUGGLED))
        (answer,) = parse_responses(raw)
        assert answer.status == 400
        assert "takes no request body" in answer.error_message
        raw, _ = await exchange(port_of(url), completion("victim"))
        (victim,) = parse_responses(raw)
    assert victim.status == 200
    assert victim.headers["x-dpserve-replica"] == "r0" and victim.json()["choices"]
    assert replica.dev_calls == []
    assert replica.reached() == ["POST /v1/completions"]


async def test_a_chunked_body_on_get_models_is_refused_and_never_reaches_a_replica(
        fake_replicas):
    replica = await fake_replicas("r0")
    async with running_router([replica.url]) as (url, _):
        raw, _ = await exchange(port_of(url), request(
            "GET", "/v1/models", "transfer-encoding: chunked", body=chunked(SLEEP),
            length=False))
        (answer,) = parse_responses(raw)
    assert answer.status == 400
    assert replica.dev_calls == [] and replica.reached() == []


async def test_head_of_a_forwarded_route_is_refused_without_reaching_a_replica(fake_replicas):
    replica = await fake_replicas("r0")
    async with running_router([replica.url]) as (url, _):
        raw, _ = await exchange(port_of(url), request(
            "HEAD", "/v1/models", f"content-length: {len(SLEEP)}", body=SLEEP))
    assert raw.startswith(b"HTTP/1.1 405 ")
    assert replica.reached() == [] and replica.dev_calls == []


@pytest.mark.parametrize("framing", [
    # CL.TE and TE.CL desync attempts: the front must not pick one reading silently.
    ("content-length: {n}", "transfer-encoding: chunked"),
    ("transfer-encoding: chunked", "content-length: {n}"),
    ("content-length: {n}", "content-length: 4"),
    ("transfer-encoding: chunked", "transfer-encoding: identity"),
    ("transfer-encoding: xchunked",),
    ("transfer-encoding : chunked",),
    ("content-length: {n}", "transfer-encoding:\tchunked"),
], ids=["cl-te", "te-cl", "cl-cl", "te-te", "te-obfuscated", "te-space", "te-tab"])
async def test_ambiguous_request_framing_never_smuggles_a_request(fake_replicas, framing):
    replica = await fake_replicas("r0")
    smuggled_body = chunked(SLEEP)
    headers = [h.format(n=len(smuggled_body)) for h in framing]
    async with running_router([replica.url]) as (url, _):
        raw, _ = await exchange(port_of(url), request(
            "POST", "/v1/completions", *headers, body=smuggled_body, length=False))
        answers = parse_responses(raw)
        raw, _ = await exchange(port_of(url), completion("victim"))
        (victim,) = parse_responses(raw)
    assert answers, "the router answered nothing"
    assert all(a.status in (400, 413) for a in answers), [a.status for a in answers]
    assert victim.headers["x-dpserve-replica"] == "r0" and victim.json()["choices"]
    assert replica.dev_calls == []
    assert replica.reached() == ["POST /v1/completions"]  # the victim's own, nothing else


async def test_pipelined_requests_are_answered_in_order_each_framed_on_its_own(fake_replicas):
    replica = await fake_replicas("r0")
    async with running_router([replica.url]) as (url, _):
        raw, _ = await exchange(port_of(url), request("GET", "/v1/models")
                                + completion("one") + completion("two"))
        answers = parse_responses(raw)
    assert [a.status for a in answers] == [200, 200, 200]
    assert answers[0].json()["object"] == "list"
    assert [r["prompt"] for r in replica.requests] == ["one", "two"]
    assert replica.reached() == ["POST /v1/completions", "POST /v1/completions"]


async def test_a_chunked_request_body_is_forwarded_with_a_content_length(fake_replicas):
    replica = await fake_replicas("r0")
    body = json.dumps({"model": "fake-model", "prompt": "chunked"}).encode()
    async with running_router([replica.url]) as (url, _):
        raw, _ = await exchange(port_of(url), request(
            "POST", "/v1/completions", "transfer-encoding: chunked", body=chunked(body),
            length=False))
        (answer,) = parse_responses(raw)
    assert answer.status == 200
    assert [as_sent(r) for r in replica.requests] == [{"model": "fake-model", "prompt": "chunked"}]
    (headers,) = replica.headers_seen
    # Framed by the router: the body it sends (a stream asked for) and its length.
    assert headers["content-length"] == str(len(ride_body(json.loads(body), body, ids=True)))
    assert "transfer-encoding" not in headers


@pytest.mark.parametrize("value", [b"a\x00b", b"a\x0bb", b"a\rb"], ids=["nul", "vt", "cr"])
async def test_a_header_value_with_a_control_character_is_refused(fake_replicas, value):
    replica = await fake_replicas("r0")
    body = json.dumps({"model": "fake-model", "prompt": "x"}).encode()
    raw_request = (b"POST /v1/completions HTTP/1.1\r\nhost: r\r\nx-note: " + value
                   + b"\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
    async with running_router([replica.url]) as (url, _):
        raw, _ = await exchange(port_of(url), raw_request)
        (answer,) = parse_responses(raw)
    assert answer.status == 400
    assert replica.reached() == []


async def test_the_client_key_and_headers_named_in_connection_stay_in_the_router(
        fake_replicas):
    replica = await fake_replicas("r0")
    async with running_router([replica.url], api_keys=["client-key-123"]) as (url, _):
        raw, _ = await exchange(port_of(url), request(
            "POST", "/v1/completions", "authorization: Bearer client-key-123",
            "connection: keep-alive, user-agent", "user-agent: private", "accept: kept",
            body=json.dumps({"model": "fake-model", "prompt": "x"}).encode()))
        (answer,) = parse_responses(raw)
    assert answer.status == 200
    (headers,) = replica.headers_seen
    assert "authorization" not in headers
    assert "user-agent" not in headers
    assert headers["accept"] == "kept"


async def test_an_extra_response_from_a_replica_never_reaches_the_next_client():
    """A replica that answers one request twice (what a smuggled request would cause):
    the router closes that connection, and the next client gets its own answer."""
    closed = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        answered_twice = False
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                body = await reader.readexactly(length)
                if head.startswith(b"GET "):  # the health checker: /health, /v1/models
                    models = b'{"object": "list", "data": [{"id": "fake-model"}]}'
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                                 b"content-length: %d\r\n\r\n%s" % (len(models), models))
                    continue
                prompt = json.loads(body)["prompt"]
                answer = json.dumps({"choices": [{"text": prompt}]}).encode()
                reply = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n%s" % (len(answer), answer))
                if prompt == "attacker":
                    answered_twice = True
                    evil = b'{"choices": [{"text": "ATTACKER-CHOSEN-ANSWER"}]}'
                    reply += (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                              b"content-length: %d\r\n\r\n%s" % (len(evil), evil))
                writer.write(reply)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            if answered_twice:
                closed.set()
            writer.close()

    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    upstream = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        async with running_router([upstream], policy="round-robin") as (url, _):
            raw, _ = await exchange(port_of(url), completion("attacker"))
            (first,) = parse_responses(raw)
            assert first.json()["choices"][0]["text"] == "attacker"
            await asyncio.wait_for(closed.wait(), 5)  # the router hung up on that stream
            raw, _ = await exchange(port_of(url), completion("victim"))
            (victim,) = parse_responses(raw)
    finally:
        server.close()
    assert victim.json()["choices"][0]["text"] == "victim"
