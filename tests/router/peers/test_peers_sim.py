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
from tests.router.kv import test_workers_sim as workers_sim
from tests.router.kv.test_two_routers_sim import metric
from tests.router.telemetry.test_series import PEER_SERIES, sample_names
from tests.router.workers.test_workers import router_with_workers
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


async def test_routers_with_several_workers_each_share_what_they_place_through_their_first():
    """Two routers of two workers each, told of each other: a prompt placed by either
    worker of one draws the other router's requests with its prefix, whichever of its
    workers takes them. Only each router's first worker talks to the peers."""
    pa, pb = free_port(), free_port()
    flags = ("--policy", "kv-aware", "--tokenizer", "sim")
    env = {"DPSERVE_PEER_KEY": KEY}
    async with Fleet(n=2, config=workers_sim.SLOW_PREFILL) as fleet, router_with_workers(
            *fleet.urls, env=env, flags=(*flags, "--peer-bind", f"127.0.0.1:{pa}", "--peer",
                                         f"127.0.0.1:{pb}")) as (a_url, _), \
            router_with_workers(*fleet.urls, env=env, flags=(
                *flags, "--peer-bind", f"127.0.0.1:{pb}", "--peer",
                f"127.0.0.1:{pa}")) as (b_url, _):
        for url in (a_url, b_url):
            await workers_sim.both_workers_on_events(url)
            await wait_for(lambda u=url: workers_sim.scraped(u, "dpserve_peers_live"),
                           "hearing the other router")
        for attempt in range(workers_sim.ATTEMPTS):
            before = await workers_sim.decisions(b_url)
            home, others = await workers_sim.tenant_follows_its_first_request(
                b_url, a_url, f"tenant {attempt} {TENANT}",
                await workers_sim.scraped(b_url, workers_sim.RELAYED))
            assert others == [home] * len(others), (home, others)
            delta = await wait_for(lambda b=before: workers_sim.counted(b_url, b, 4),
                                   "every request counted")
            if delta["0"] and delta["1"]:
                break  # both of B's workers placed some of them
        else:
            raise AssertionError("the kernel gave one of B's workers every connection "
                                 f"{workers_sim.ATTEMPTS} times")
        async with aiohttp.ClientSession() as s, s.get(b_url + "/metrics") as resp:
            text = await resp.text()
        assert metric(text, "dpserve_peers_live") == 1  # the first worker's peer link alone
        assert metric(text, "dpserve_peer_reports_rejected_total") == 0
