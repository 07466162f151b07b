"""Drains one replica after another, as a rolling deploy does: a stream moves off each
drained replica, back to one drained before once it serves again, and is never cut
while a replica can take it or is coming into rotation.

Against the shared fake engine in its token mode (`tests.fake_tokens`); a replica
stalls after k tokens (`hang_after_tokens`) so that a drain always finds the stream
running there, however slow the machine.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from tests.conftest import running_router
from tests.fake_tokens import expected_text
from tests.router.migration.helpers import COMPLETION, all_ready, final, stream, text
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
        task = asyncio.create_task(stream(base, "/v1/completions", COMPLETION))
        await wait_for(lambda: streams.movable("r0"), "the stream on r0")
        assert (await drain(c, base, "r0"))["moved_streams"] == 1
        await wait_for(lambda: streams.movable("r1").migrating, "the stream going on r1")
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
