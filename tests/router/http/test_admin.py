"""The router's /admin control plane, against FakeReplicas (see tests/fakes.py)."""

from __future__ import annotations

import asyncio

import httpx

from dpserve.router.fleet.pool import ReplicaState
from tests.conftest import running_router
from tests.fakes import MODEL
from tests.waiting import wait_for

BODY = {"model": MODEL, "prompt": "hi", "max_tokens": 4}


async def test_the_replica_list_shows_state_load_and_models(fake_replicas):
    a, b = await fake_replicas("a"), await fake_replicas("b")
    async with running_router([a.url, b.url]) as (base, _), httpx.AsyncClient() as c:
        listing = (await c.get(base + "/admin/replicas")).json()["replicas"]
    assert [(r["id"], r["url"], r["state"], r["in_flight"], r["models"]) for r in listing] == [
        ("r0", a.url, "ready", 0, [MODEL]), ("r1", b.url, "ready", 0, [MODEL])]


async def test_a_drained_replica_gets_no_new_requests_until_undrained(fake_replicas):
    a, b = await fake_replicas("a"), await fake_replicas("b")
    async with running_router([a.url, b.url]) as (base, router), httpx.AsyncClient() as c:
        drained = await c.post(base + "/admin/replicas/r0/drain")
        served = [(await c.post(base + "/v1/completions", json=BODY)).headers["x-dpserve-replica"]
                  for _ in range(6)]
        undrained = await c.post(base + "/admin/replicas/r0/undrain")
        state_after = router.pool.get("r0").state
    assert drained.status_code == 200 and drained.json()["state"] == "draining"
    assert drained.json()["drained"] is True
    assert served == ["r1"] * 6
    assert len(a.requests) == 0
    assert undrained.json()["state"] == "ready" and state_after is ReplicaState.READY


async def test_drain_with_wait_returns_once_in_flight_requests_finished(fake_replicas):
    a = await fake_replicas("a", chunks=6, chunk_delay_s=0.1)
    async with running_router([a.url]) as (base, router), httpx.AsyncClient() as c:
        stream = asyncio.create_task(
            c.post(base + "/v1/completions", json={**BODY, "stream": True}))
        await wait_for(lambda: router.pool.get("r0").in_flight, "the stream to start")
        drained = await c.post(base + "/admin/replicas/r0/drain", json={"wait_s": 10})
        streams_open_at_answer = a.open_streams
        response = await stream
    assert drained.json()["drained"] is True and drained.json()["in_flight"] == 0
    assert streams_open_at_answer == 0  # drain answered only after the stream had ended...
    assert response.status_code == 200 and response.text.count("data: ") == 7  # ...whole


async def test_drain_gives_up_waiting_at_its_deadline(fake_replicas):
    a = await fake_replicas("a", mode="hang")
    async with running_router([a.url]) as (base, router), httpx.AsyncClient() as c:
        hung = asyncio.create_task(c.post(base + "/v1/completions", json=BODY, timeout=30))
        await wait_for(lambda: router.pool.get("r0").in_flight, "the request to reach r0")
        drained = await c.post(base + "/admin/replicas/r0/drain", json={"wait_s": 0.3})
        hung.cancel()
    assert drained.status_code == 200
    assert drained.json()["drained"] is False and drained.json()["in_flight"] == 1


async def test_bad_admin_requests_get_the_error_envelope(fake_replicas):
    a = await fake_replicas("a")
    async with running_router([a.url]) as (base, _), httpx.AsyncClient() as c:
        unknown = await c.post(base + "/admin/replicas/nope/drain")
        bad_wait = await c.post(base + "/admin/replicas/r0/drain", json={"wait_s": "soon"})
        negative = await c.post(base + "/admin/replicas/r0/drain", json={"wait_s": -1})
        not_json = await c.post(base + "/admin/replicas/r0/drain", content=b"{oops")
        wrong_method = await c.get(base + "/admin/replicas/r0/drain")
        still_ready = (await c.get(base + "/admin/replicas")).json()["replicas"][0]["state"]
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "replica_id"
    assert bad_wait.status_code == negative.status_code == 400
    assert bad_wait.json()["error"]["param"] == "wait_s"
    assert not_json.status_code == 400
    assert wrong_method.status_code == 405
    assert still_ready == "ready"  # a refused drain changes nothing
