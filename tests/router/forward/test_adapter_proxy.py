"""Requests naming a LoRA adapter, tried on the socket: the router rewrites their body
(the model becomes the engine's `NAME@VERSION`), so what reaches the replica must
still be exactly one request the router framed itself, whatever the client sent.
A real router in front of the shared fake replica, which logs every request."""

from __future__ import annotations

import json

from dpserve.config import RouterConfig
from dpserve.router.fleet.adapters import Adapters, AdapterVersion
from dpserve.router.fleet.pool import Replica, ReplicaPool, ReplicaState
from dpserve.router.http.app import Router
from tests.conftest import serving
from tests.fakes import MODEL, as_sent
from tests.router.forward.test_smuggling import SMUGGLED, chunked, port_of
from tests.router.rawhttp import completion, exchange, parse_responses, request
from tests.waiting import wait_for


def served(name: str, version: str) -> tuple[Adapters, AdapterVersion]:
    adapters = Adapters()
    adapters.add(v := AdapterVersion(name, version, f"/snap/{version}", 8))
    adapters.switch(v)
    return adapters, v


async def ready_with(router: Router, engine_name: str) -> None:
    """The replica in rotation holding the adapter (as a deploy leaves it)."""
    (replica,) = router.pool
    await wait_for(lambda: replica.state is ReplicaState.READY, "the replica ready")
    replica.models = replica.models | {engine_name}


async def test_an_adapter_request_reaches_the_replica_reframed_and_alone(fake_replicas):
    replica = await fake_replicas("r0")
    adapters, v1 = served("support", "v1")
    router = Router(ReplicaPool([Replica("r0", replica.url)]),
                    RouterConfig(health_interval_s=0.2), adapters=adapters)
    # Chunked, a lone surrogate (valid JSON, not encodable as UTF-8), smuggled bytes
    # inside a string, then a second request pipelined on the same connection.
    body = (b'{"model":"support","prompt":"\\ud800 ' + SMUGGLED.replace(b'"', b'\\"')
            .replace(b"\r\n", b"\\r\\n") + b'","max_tokens":2}')
    async with serving(router) as (url, _):
        await ready_with(router, v1.engine_name)
        raw, _ = await exchange(port_of(url), request(
            "POST", "/v1/completions", "content-type: application/json",
            "transfer-encoding: chunked", body=chunked(body), length=False),
            completion("victim"))
    first, second = parse_responses(raw)
    assert (first.status, second.status) == (200, 200)
    assert first.headers["x-dpserve-weight-version"] == "v1"
    assert replica.reached() == ["POST /v1/completions", "POST /v1/completions"]
    assert replica.dev_calls == []
    sent = json.loads(body)
    assert as_sent(replica.requests[0]) == {**sent, "model": "support@v1"}
    assert replica.requests[1]["prompt"] == "victim"
    assert v1.in_flight == 0  # the lease ended with the response


async def test_a_replaced_version_or_a_bad_body_is_a_4xx_that_reaches_no_replica(
        fake_replicas):
    replica = await fake_replicas("r0")
    adapters, v1 = served("support", "v1")
    adapters.add(v2 := AdapterVersion("support", "v2", "/snap/v2", 8))
    adapters.switch(v2)  # v1 retires
    router = Router(ReplicaPool([Replica("r0", replica.url)]),
                    RouterConfig(health_interval_s=0.2, max_body_bytes=8192),
                    adapters=adapters)
    async with serving(router) as (url, _):
        await ready_with(router, v2.engine_name)
        cases = [
            (json.dumps({"model": "support@v1", "prompt": "x"}).encode(), 404,
             "serves version v2"),
            (json.dumps({"model": "support@v9", "prompt": "x"}).encode(), 404,
             "does not exist"),
            (json.dumps({"model": "nope", "prompt": "x"}).encode(), 404,  # by client names
             f"The model `nope` does not exist. Served here: `{MODEL}`, `support`."),
            (b'{"model": "support", "prompt": "' + b"x" * 9000 + b'"}', 413, "larger"),
            (b'{"model": "support", "prompt": ' + b"[" * 3000 + b"]" * 3000 + b"}", 400,
             "nested too deeply"),
            (b'{"model": "support", "prompt": "x"', 400, "not valid JSON"),
        ]
        for body, status, message in cases:
            raw, _ = await exchange(port_of(url), request(
                "POST", "/v1/completions", "content-type: application/json", body=body))
            (answer,) = parse_responses(raw)
            assert answer.status == status, (body[:40], answer.status)
            assert message in answer.error_message
    assert replica.reached() == []
    assert v1.in_flight == v2.in_flight == 0


async def test_a_withdrawn_adapter_pinned_by_version_reaches_no_replica(fake_replicas):
    """After a full deploy with drop_adapters, `support` is a 404 and so is
    `support@v1`, though the engine still holds v1 until its unload ends."""
    replica = await fake_replicas("r0")
    adapters, v1 = served("support", "v1")
    router = Router(ReplicaPool([Replica("r0", replica.url)]),
                    RouterConfig(health_interval_s=0.2), adapters=adapters)
    async with serving(router) as (url, _):
        await ready_with(router, v1.engine_name)
        adapters.withdraw("support")  # what drop_adapters does; the unload waits for v1
        for model in ("support@v1", "support"):
            raw, _ = await exchange(port_of(url), request(
                "POST", "/v1/completions", "content-type: application/json",
                body=json.dumps({"model": model, "prompt": "x"}).encode()))
            (answer,) = parse_responses(raw)
            assert answer.status == 404, (model, answer.status)
    assert replica.reached() == []
