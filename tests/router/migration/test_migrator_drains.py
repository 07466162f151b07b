"""Drains one replica after another, as a rolling deploy does: a stream moves off each
drained replica, back to one drained before once it serves again, and is never cut
while a replica can take it or is coming into rotation.

Against the shared fake engine in its token mode (`tests.fake_tokens`); a replica
stalls after k tokens (`hang_after_tokens`) so that a drain always finds the stream
running there, however slow the machine.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx
import pytest

from tests.conftest import running_router
from tests.fake_tokens import expected_text
from tests.router.migration.helpers import (
    COMPLETION,
    all_ready,
    final,
    scrape,
    stream,
    text,
)
from tests.waiting import wait_for


def seams(events: list[dict[str, Any] | str]) -> list[tuple[str, str, str]]:
    return [(s["from"], s["to"], s["reason"])
            for s in final(events).get("dpserve", {}).get("migrations", [])]


async def drain(c: httpx.AsyncClient, base: str, replica: str) -> dict[str, Any]:
    r = await c.post(f"{base}/admin/replicas/{replica}/drain", json={"move_streams": True})
    assert r.status_code == 200, r.text
    return dict(r.json())


@pytest.mark.parametrize("first_leg", ["before-its-first-chunk", "mid-stream"])
async def test_a_stream_moves_back_to_a_replica_drained_before_once_it_serves(
        fake_replicas, first_leg):
    """r0 drained: the stream goes to r1; r0 back in rotation; r1 drained: the stream
    goes back to r0 (r0 did not fail, it was drained) and ends as it would have."""
    gate = asyncio.Event()
    if first_leg == "mid-stream":
        a = await fake_replicas("a", tokens=True, hang_after_tokens=3)
    else:  # queued on r0: it starts over on r1
        a = await fake_replicas("a", tokens=True, first_chunk_gate=gate)
    b = await fake_replicas("b", tokens=True, hang_after_tokens=5)
    async with running_router([a.url, b.url], policy="round-robin") as (base, router), \
            httpx.AsyncClient(timeout=20) as c:
        await all_ready(router, 2)
        streams = router.dispatcher.streams
        got: list[dict[str, Any] | str] = []
        task = asyncio.create_task(stream(base, "/v1/completions", COMPLETION, into=got))
        await wait_for(lambda: streams.movable("r0"), "the stream on r0")
        assert (await drain(c, base, "r0"))["moved_streams"] == 1
        await wait_for(lambda: streams.replicas() == ["r1"] and got,
                       "the stream going on r1, its chunks reaching the client")
        a.hang_after_tokens = None
        gate.set()
        assert (await c.post(base + "/admin/replicas/r0/undrain")).json()["state"] == "ready"
        assert (await drain(c, base, "r1"))["moved_streams"] == 1
        events = await asyncio.wait_for(task, 20)
    assert text(events) == expected_text(COMPLETION, 12) and events[-1] == "[DONE]"
    assert not any("error" in e for e in events[:-1])
    back = [("r1", "r0", "drained")]
    assert seams(events) == ([("r0", "r1", "drained"), *back] if first_leg == "mid-stream"
                             else back)



async def test_a_drain_leaves_a_stream_where_it_is_while_no_replica_could_take_it(
        fake_replicas):
    """Moved off r1 with r0 drained and nothing coming, the stream would be cut: it
    stays on r1 (still serving it) until a drain finds r0 back in rotation."""
    a = await fake_replicas("a", tokens=True)
    b = await fake_replicas("b", tokens=True, hang_after_tokens=5)
    async with running_router([a.url, b.url], policy="round-robin") as (base, router), \
            httpx.AsyncClient(timeout=20) as c:
        await all_ready(router, 2)
        await drain(c, base, "r0")
        got: list[dict[str, Any] | str] = []
        task = asyncio.create_task(stream(base, "/v1/completions", COMPLETION, into=got))
        await wait_for(lambda: got, "the stream's first chunk, from r1")
        stayed = await drain(c, base, "r1")
        assert stayed["moved_streams"] == 0 and stayed["drained"] is False, stayed
        assert not task.done() and router.pool.get("r1").in_flight == 1
        await c.post(base + "/admin/replicas/r0/undrain")
        assert (await drain(c, base, "r1"))["moved_streams"] == 1
        events = await asyncio.wait_for(task, 20)
    assert text(events) == expected_text(COMPLETION, 12) and events[-1] == "[DONE]"
    assert seams(events) == [("r1", "r0", "drained")]


async def test_a_stream_moved_while_a_replica_comes_into_rotation_waits_for_it(
        fake_replicas):
    """r0 starting again (undrained, its engine not healthy yet) when r1 is drained: the
    stream leaves r1 and goes on on r0 once r0 is ready, instead of being cut."""
    a = await fake_replicas("a", tokens=True)
    b = await fake_replicas("b", tokens=True, hang_after_tokens=5)
    async with running_router([a.url, b.url], policy="round-robin") as (base, router), \
            httpx.AsyncClient(timeout=20) as c:
        await all_ready(router, 2)
        await drain(c, base, "r0")
        got: list[dict[str, Any] | str] = []
        task = asyncio.create_task(stream(base, "/v1/completions", COMPLETION, into=got))
        await wait_for(lambda: got, "the stream's first chunk, from r1")
        a.healthy = False
        assert (await c.post(base + "/admin/replicas/r0/undrain")).json()["state"] == "starting"
        assert (await drain(c, base, "r1"))["moved_streams"] == 1
        await wait_for(lambda: router.dispatcher.queue.waiting == 1,
                       "the stream waiting for a replica")
        a.healthy = True
        events = await asyncio.wait_for(task, 20)
        metrics = await scrape(base)
    assert text(events) == expected_text(COMPLETION, 12) and events[-1] == "[DONE]"
    assert seams(events) == [("r1", "r0", "drained")]
    assert 'dpserve_migrations_total{outcome="migrated",reason="drained"} 1.0' in metrics


async def test_a_stream_waits_for_a_replica_coming_into_rotation_no_longer_than_the_queue(
        fake_replicas, caplog):
    caplog.set_level(logging.INFO, logger="dpserve.migration")
    a = await fake_replicas("a", tokens=True, healthy=False)  # starting, and staying so
    b = await fake_replicas("b", tokens=True, hang_after_tokens=5)
    async with running_router([a.url, b.url], policy="round-robin",
                              queue_timeout_s=0.3) as (base, router), \
            httpx.AsyncClient(timeout=20) as c:
        await all_ready(router, 1)
        got: list[dict[str, Any] | str] = []
        task = asyncio.create_task(stream(base, "/v1/completions", COMPLETION, into=got))
        await wait_for(lambda: got, "the stream's first chunk, from r1")
        assert (await drain(c, base, "r1"))["moved_streams"] == 1
        events = await asyncio.wait_for(task, 20)
        metrics = await scrape(base)
    assert "stream interrupted: replica r1 drained" in events[-2]["error"]["message"]
    assert events[-1] == "[DONE]" and a.requests == []
    assert 'dpserve_migrations_total{outcome="failed",reason="drained"} 1.0' in metrics
    said = [r.getMessage().split(": ", 1)[1] for r in caplog.records
            if r.name == "dpserve.migration"]
    assert said == ["no replica ready to carry the stream on; waiting up to 0.3 s for r0, "
                    "coming into rotation", "stream cut (replica r1 drained), not migrated: "
                    "no replica came into rotation within 0.3 s"]


async def test_a_stream_drained_before_its_first_chunk_starts_over_only_where_it_can(
        fake_replicas):
    """Queued on r0 with r1 drained, the stream stays (a drain would turn it into a 503);
    with r1 starting again, it is moved and waits for r1 to serve it."""
    a = await fake_replicas("a", tokens=True, first_chunk_gate=asyncio.Event())
    b = await fake_replicas("b", tokens=True)
    async with running_router([a.url, b.url], policy="round-robin") as (base, router), \
            httpx.AsyncClient(timeout=20) as c:
        await all_ready(router, 2)
        await drain(c, base, "r1")
        task = asyncio.create_task(stream(base, "/v1/completions", COMPLETION))
        await wait_for(lambda: router.dispatcher.streams.replicas() == ["r0"],
                       "the stream queued on r0")
        assert (await drain(c, base, "r0"))["moved_streams"] == 0
        b.healthy = False
        await c.post(base + "/admin/replicas/r1/undrain")
        assert (await drain(c, base, "r0"))["restarted_streams"] == 1
        await wait_for(lambda: router.dispatcher.queue.waiting == 1,
                       "the stream waiting for r1")
        b.healthy = True
        events = await asyncio.wait_for(task, 20)
    assert text(events) == expected_text(COMPLETION, 12) and events[-1] == "[DONE]"
    assert [len(a.requests), len(b.requests)] == [1, 1]
