"""Control-plane clients are built off the event loop, which keeps proxying meanwhile."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx

from dpserve.httpclient import open_client


async def test_a_slow_client_build_does_not_stall_the_event_loop():
    loop_thread = threading.get_ident()
    built_on: list[int] = []

    def slow_factory() -> httpx.AsyncClient:
        built_on.append(threading.get_ident())
        time.sleep(0.3)  # a TLS context built on a busy core
        return httpx.AsyncClient()

    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    ticking = asyncio.create_task(tick())
    async with await open_client(slow_factory) as client:
        assert isinstance(client, httpx.AsyncClient)
    ticking.cancel()
    assert built_on and built_on[0] != loop_thread
    assert ticks >= 10  # the loop kept running while the client was built
