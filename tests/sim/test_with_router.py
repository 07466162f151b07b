"""dpserve's router in front of a simulated fleet: requests spread over the replicas,
a replica failing its health checks leaves rotation, and comes back when healed."""

from __future__ import annotations

import asyncio

import aiohttp

from dpserve.sim import Fault, Fleet
from tests.conftest import running_router
from tests.sim.conftest import FAST
from tests.waiting import wait_for


async def test_the_router_spreads_load_and_follows_a_replicas_health():
    async with Fleet(n=3, config=FAST) as fleet, running_router(
            fleet.urls, policy="least-outstanding") as (url, _), aiohttp.ClientSession() as s:
        served = [e.stats for e in fleet.engines]

        async def burst() -> list[int]:
            """10 concurrent requests; how many each replica finished."""
            before = [st.requests_finished for st in served]

            async def one() -> None:
                async with s.post(url + "/v1/completions", json={
                        "model": FAST.model, "prompt": "route me", "max_tokens": 20}) as resp:
                    assert resp.status == 200

            await asyncio.gather(*(one() for _ in range(10)))
            return [st.requests_finished - b for st, b in zip(served, before, strict=True)]

        async def all_three_serve() -> bool:
            return all(n > 0 for n in await burst())

        await wait_for(all_three_serve, what="the router to use every replica")

        fleet.set_fault(0, Fault(health_status=503))  # serves, but fails health checks

        async def first_out() -> bool:
            return (await burst())[0] == 0

        await wait_for(first_out, what="replica 0 to leave rotation")
        fleet.clear_fault(0)
        await wait_for(all_three_serve, what="replica 0 to come back")
