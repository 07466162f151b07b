"""What a client may tell an engine through headers: only the allow-list passes.

vLLM 0.32 acts on headers besides the body: `X-data-parallel-rank` (which engine of a
data-parallel server), `X-Vllm-Priority` (the request's scheduling priority),
`endpoint-load-metrics-format` (the engine's load, in the response's headers). Sent
through the router, on every forwarded route and on a migrated stream's continuation,
none reaches the shared fake engine, which logs every header it got.
"""

from __future__ import annotations

import httpx
import pytest

from dpserve.router.headers import FORWARDED_HEADERS
from tests.conftest import running_router
from tests.router.migration.helpers import COMPLETION, all_ready

ACTED_ON = {"x-data-parallel-rank": "1", "x-vllm-priority": "-100",
            "endpoint-load-metrics-format": "json", "x-forwarded-for": "203.0.113.9",
            "cookie": "session=secret", "x-api-key": "sk-secret", "x-anything": "else"}
KEPT = {"accept": "application/json", "user-agent": "OpenAI/Python 1.99",
        "x-session-id": "conversation-7"}
ROUTES = [("/v1/completions", {"model": "fake-model", "prompt": "hi"}),
          ("/v1/chat/completions",
           {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]})]
"""The routes the fake logs the headers of; every forwarded route writes its head with
the same function (`upstream_header_block`, whose property test covers any header)."""


def seen(replica, before: int) -> list[dict[str, str]]:
    return [{k.lower(): v for k, v in h.items()} for h in replica.headers_seen[before:]]


@pytest.mark.parametrize(("route", "body"), ROUTES)
async def test_headers_an_engine_acts_on_never_reach_it(fake_replicas, route, body):
    replica = await fake_replicas("r0")
    async with running_router([replica.url]) as (base, _), httpx.AsyncClient() as c:
        r = await c.post(base + route, json=body, headers=ACTED_ON | KEPT)
    assert r.status_code == 200
    (headers,) = seen(replica, 0)
    assert not set(ACTED_ON) & set(headers)
    assert {k: headers[k] for k in KEPT} == KEPT
    assert set(headers) <= {n.decode() for n in FORWARDED_HEADERS} | {
        "host", "content-length", "x-request-id"}


async def test_a_continuation_carries_no_more_than_the_request_did(fake_replicas):
    a = await fake_replicas("a", tokens=True, cut_after_tokens=3)
    b = await fake_replicas("b", tokens=True)
    async with running_router([a.url, b.url], policy="round-robin") as (base, router):
        await all_ready(router, 2)
        async with httpx.AsyncClient(timeout=20) as c, c.stream(
                "POST", base + "/v1/completions", json=COMPLETION,
                headers=ACTED_ON | KEPT) as r:
            body = await r.aread()
    assert r.status_code == 200 and b'"migrations"' in body and b"[DONE]" in body
    assert isinstance(b.requests[0]["prompt"], list)  # b got the continuation
    for headers in seen(a, 0) + seen(b, 0):
        assert not set(ACTED_ON) & set(headers), headers
    (continued, *_) = seen(b, 0)
    assert continued["x-session-id"] == "conversation-7"
