"""JSON nested just under the parser's limit, on every forwarded route: a 400 or an
answer, never a 500 or a traceback.

The router parses a client's body once (depth bounded by Python's recursion limit,
where it stands at that point) and writes client JSON again on some paths: a model
renamed for an adapter, a stream asked for token ids, a migrated stream's
continuation. Those run deeper in the stack than the parse, so a body that parsed
could fail to be written (a 500 with an ERROR traceback, seen on the migration
path). The sweep finds where the router's parse gives up, then walks the depths
across it on every route, streamed or not, on an adapter or not, with the stream's
replica cut so that it migrates. Against the shared fake engine (it logs what it got).
"""

from __future__ import annotations

import logging

import httpx
import pytest

from dpserve.config import RouterConfig
from dpserve.router.fleet.pool import Replica, ReplicaPool
from dpserve.router.http.app import Router
from tests.conftest import serving
from tests.fakes import MODEL
from tests.router.forward.test_adapter_proxy import served
from tests.router.migration.helpers import all_ready

HEADS = {
    "/v1/completions": b'"prompt":"hi","max_tokens":6',
    "/v1/chat/completions": b'"messages":[{"role":"user","content":"hi"}],"max_tokens":6',
    "/v1/embeddings": b'"input":"hi"',
    "/tokenize": b'"prompt":"hi"',
    "/detokenize": b'"tokens":[1,2]',
}
STREAMED = ("/v1/completions", "/v1/chat/completions")


def deep(route: str, depth: int, *, model: str = MODEL, stream: bool = False,
         ids: bool = False) -> bytes:
    """A body whose `user` (a field a continuation carries on) nests `depth` lists,
    written as bytes (json.dumps would itself run out of stack)."""
    extra = (b',"stream":true' if stream else b"") + (b',"return_token_ids":true' if ids
                                                      else b"")
    return (b'{"model":"%s",%s%s,"user":' % (model.encode(), HEADS[route], extra)
            + b"[" * depth + b"]" * depth + b"}")


async def post(url: str, route: str, body: bytes) -> tuple[int, bytes]:
    async with httpx.AsyncClient(timeout=20) as c:
        r = await c.post(url + route, content=body,
                         headers={"content-type": "application/json"})
    return r.status_code, r.content


async def parse_limit(url: str) -> int:
    """The smallest depth the router refuses as nested too deeply, where it parses."""
    low, high = 1, 20_000
    while low < high:
        mid = (low + high) // 2
        status, body = await post(url, "/tokenize", deep("/tokenize", mid))
        if status == 400 and b"nested too deeply" in body:
            high = mid
        else:
            assert status == 200, (mid, status, body[:200])
            low = mid + 1
    return low


async def test_every_route_answers_json_nested_across_the_limit_without_a_500(
        fake_replicas, caplog):
    caplog.set_level(logging.WARNING)
    # Both cut every stream: each moves, and moves again until its migration limit.
    cut = await fake_replicas("cut", tokens=True, cut_after_tokens=2, max_model_len=64)
    whole = await fake_replicas("whole", tokens=True, cut_after_tokens=3, max_model_len=64)
    adapters, v1 = served("support", "v1")
    router = Router(ReplicaPool([Replica("r0", cut.url), Replica("r1", whole.url)]),
                    RouterConfig(health_interval_s=0.2, policy="round-robin",
                                 breaker_failures=1_000_000),  # cut on purpose
                    adapters=adapters)
    async with serving(router) as (url, _):
        await all_ready(router, 2)
        for replica in router.pool:
            replica.models = replica.models | {v1.engine_name}
        limit = await parse_limit(url)
        cases = [(route, MODEL, False, False) for route in HEADS] + [
            (route, model, True, ids) for route in STREAMED for model in (MODEL, "support")
            for ids in (False, True)] + [("/v1/completions", "support", False, False)]
        statuses: dict[int, int] = {}
        for depth in range(limit - 30, limit + 2):
            for route, model, stream, ids in cases:
                status, body = await post(url, route, deep(route, depth, model=model,
                                                           stream=stream, ids=ids))
                statuses[status] = statuses.get(status, 0) + 1
                # A non-streamed completion rides on a stream, cut by both: its answer
                # is the 502 of a stream cut past its migration limit.
                assert status in (200, 400) or (status == 502 and not stream
                                                and b"stream interrupted" in body), (
                    route, model, stream, depth - limit, status, body[:300])
                if status == 400:  # the router's refusal, or a generating model's
                    assert b"nested too deeply" in body or (
                        route == "/v1/embeddings" and b"not an embedding model" in body), \
                        body[:300]
    answered_5xx = router.metrics.registry.get_sample_value(
        "dpserve_requests_total", {"route": "/v1/completions", "replica": "none",
                                   "status_class": "5xx"})
    assert not answered_5xx
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [], [r.getMessage()[:200] for r in errors]
    assert statuses.get(200) and statuses.get(400)  # the walk crossed the limit
    migrated = router.metrics.registry.get_sample_value(
        "dpserve_migrations_total", {"reason": "disconnected", "outcome": "migrated"})
    refused = router.metrics.registry.get_sample_value(
        "dpserve_migration_refusals_total", {"reason": "nested_too_deeply"})
    assert migrated and refused, (migrated, refused)  # both sides of the seam's limit


@pytest.mark.parametrize("route", list(HEADS))
async def test_a_body_too_deep_to_parse_reaches_no_replica(fake_replicas, route):
    replica = await fake_replicas("r0")
    router = Router(ReplicaPool([Replica("r0", replica.url)]),
                    RouterConfig(health_interval_s=0.2))
    async with serving(router) as (url, _):
        await all_ready(router, 1)
        status, body = await post(url, route, deep(route, 100_000))
    assert status == 400 and b"nested too deeply" in body
    assert replica.reached() == []
