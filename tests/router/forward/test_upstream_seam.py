"""The router reaches the replicas only through the upstream client it is given
(`Router(upstream=...)`), as httpx reaches the network through its transport: a
stand-in answering from memory sees every forwarded request as the router framed it,
and every response it hands out is released, whether read to its end or not."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator

import httpx

from dpserve.config import RouterConfig
from dpserve.router.fleet.pool import Replica, ReplicaPool, ReplicaState
from dpserve.router.http.app import Router, build_app
from dpserve.router.upstream.client import Origin, UpstreamResponse
from tests.fakes import as_sent

MODEL = "tiny"
SSE = [(b"content-type", b"text/event-stream")]


class FromMemory:
    """An upstream client that answers every request with one canned response."""

    def __init__(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        self.answer = (status, headers, body)
        self.sent: list[tuple[str, bytes, bytes, bytes]] = []
        self.released: list[UpstreamResponse] = []
        self.closed = False

    @contextlib.asynccontextmanager
    async def open(self, origin: Origin, target: bytes, headers: bytes, body: bytes, *,
                   connect_timeout_s: float | None, head_timeout_s: float | None,
                   ) -> AsyncIterator[UpstreamResponse]:
        self.sent.append((f"{origin.host}:{origin.port}", target, headers, body))
        resp = UpstreamResponse.canned(*self.answer)
        try:
            yield resp
        finally:
            self.released.append(resp)

    def close(self) -> None:
        self.closed = True


def router(upstream: FromMemory) -> Router:
    pool = ReplicaPool([Replica(id="r0", url="http://127.0.0.1:9001",
                                state=ReplicaState.READY, models=frozenset({MODEL}))])
    return Router(pool, RouterConfig(), upstream=upstream)


async def test_a_request_reaches_the_given_client_framed_by_the_router():
    upstream = FromMemory(200, [(b"content-type", b"application/json")],
                          b'{"id": "cmpl-1", "object": "text_completion", "model": "tiny"}')
    app = build_app(router(upstream))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://router") as client:
        answer = await client.post("/v1/completions?x=1", json={"model": MODEL, "prompt": "hi"},
                                   headers={"x-api-key": "not forwarded"})
    assert answer.status_code == 200 and answer.json()["id"] == "cmpl-1"
    assert answer.headers["x-dpserve-replica"] == "r0"
    [(where, target, headers, body)] = upstream.sent
    assert (where, target) == ("127.0.0.1:9001", b"POST /v1/completions?x=1")
    assert as_sent(json.loads(body)) == {"model": MODEL, "prompt": "hi"}
    assert headers.endswith(b"\r\n\r\n") and b"x-api-key" not in headers.lower()
    assert b"content-length: %d\r\n" % len(body) in headers
    assert len(upstream.released) == 1


async def test_a_stream_the_client_read_to_its_end_releases_its_response():
    events = b'data: {"id":"c","object":"text_completion","model":"tiny","choices":' \
             b'[{"index":0,"text":"hi","finish_reason":"length"}]}\n\ndata: [DONE]\n\n'
    upstream = FromMemory(200, SSE, events)
    app = build_app(router(upstream))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://router") as client:
        answer = await client.post("/v1/completions", json={
            "model": MODEL, "prompt": "hi", "stream": True, "max_tokens": 1})
    assert answer.status_code == 200
    assert answer.text.endswith("data: [DONE]\n\n") and '"text":"hi"' in answer.text
    assert len(upstream.sent) == 1 and len(upstream.released) == 1


async def test_the_router_closes_the_client_it_was_given():
    upstream = FromMemory(200, [], b"")
    r = router(upstream)
    await r.aclose()
    assert upstream.closed
