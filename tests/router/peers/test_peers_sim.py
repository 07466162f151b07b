"""Two kv-aware routers told of each other (`--peer`), in front of one simulated fleet
publishing KV events: a prompt one of them placed draws the other's request with the
same prefix while its engine is still computing it, before any event says so."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator

import aiohttp

from dpserve.replicas.launcher import free_port
from dpserve.router.http.app import Router
from dpserve.router.routing.policies import kv_aware_of
from dpserve.sim import Fleet
from tests.conftest import running_router
from tests.router.kv.test_two_routers_sim import metric
from tests.router.telemetry.test_series import PEER_SERIES, sample_names
from tests.sim.conftest import FAST
from tests.waiting import wait_for

SLOW_PREFILL = dataclasses.replace(FAST, kv_events=True, prefill_per_token_s=0.004)
"""A 200-token prompt prefills for ~0.8 s in one step: its blocks are published after."""
TENANT = " ".join(f"rule{i:03d} of the tenant" for i in range(60))  # ~200 tokens
KEY = "a-test-key-for-the-peers-0123456789"


@contextlib.asynccontextmanager
async def peered_routers(fleet: Fleet) -> AsyncIterator[list[tuple[str, Router]]]:
    pa, pb = free_port(), free_port()
    common = {"policy": "kv-aware", "tokenizer": "sim", "peer_key": KEY}
    async with running_router(fleet.urls, peers=[f"127.0.0.1:{pb}"],
                              peer_bind=f"127.0.0.1:{pa}", **common) as a, running_router(
            fleet.urls, peers=[f"127.0.0.1:{pa}"], peer_bind=f"127.0.0.1:{pb}",
            **common) as b:
        yield [a, b]


async def complete(s: aiohttp.ClientSession, url: str, prompt: str) -> str:
    async with s.post(url + "/v1/completions", json={
            "model": SLOW_PREFILL.model, "prompt": prompt, "max_tokens": 2}) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()
        return resp.headers["x-dpserve-replica"]


async def test_a_prompt_placed_by_one_router_draws_the_others_request_with_its_prefix():
    async with Fleet(n=2, config=SLOW_PREFILL) as fleet, peered_routers(fleet) as routers, \
            aiohttp.ClientSession() as s:
        (a_url, a), (b_url, b) = routers
        assert a.peers is not None and b.peers is not None
        for router in (a, b):
            assert router.kv is not None
            await wait_for(lambda r=router: r.kv.feeds.status == {  # type: ignore[union-attr]
                "r0": "following", "r1": "following"}, what="following both replicas")
        for i, url in enumerate(fleet.urls):  # each engine publishes: both are indexed
            async with s.post(url + "/v1/completions", json={
                    "model": SLOW_PREFILL.model, "prompt": f"warm {i} " * 20,
                    "max_tokens": 1}) as resp:
                assert resp.status == 200
        for router in (a, b):
            assert router.kv is not None
            await wait_for(lambda r=router: all(r.kv.index.block_size(f"r{i}") is not None
                                                for i in range(2)),
                           what="both replicas in each router's index")
        # B places something first, so that alone it would place its next new prompt on
        # the other replica than A places its first (each spreads by what it sent).
        elsewhere = await complete(s, b_url, "an unrelated question")
        url = fleet.urls[int(elsewhere.removeprefix("r"))]
        await wait_for(lambda: a.peers.state.work(url, time.monotonic()) > 0,  # type: ignore[union-attr]
                       what="A hearing B's work")
        first = asyncio.create_task(complete(s, a_url, TENANT + " question one"))
        await wait_for(lambda: b.peers.state.stats.prompts >= 1,  # type: ignore[union-attr]
                       what="B hearing the prompt A placed")
        second = await complete(s, b_url, TENANT + " question two")
        assert second == await first
        # B knew it from A's report alone: no event had said the replica held any of it.
        policy = kv_aware_of(b.policy)
        assert policy is not None and policy.stats.last_cached_tokens == 0
        async with s.get(b_url + "/metrics") as resp:  # what the dashboard's panel reads
            text = await resp.text()
        assert set(PEER_SERIES) <= sample_names(text)
        assert metric(text, "dpserve_peers_live") == 1
        assert metric(text, "dpserve_peer_prompts_total") >= 1
        assert metric(text, "dpserve_peer_reports_rejected_total") == 0
