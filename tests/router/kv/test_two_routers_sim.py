"""Two routers with `kv-aware` in front of one simulated fleet publishing KV events
(`python -m dpserve.sim --kv-events`): whichever router a conversation's next turn
reaches, it goes where the engines say the conversation's prefix is cached, and what
the routers decided is in their `/metrics`."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from dpserve.router.routing.canary import PER_BLOCK, CanarySplit
from dpserve.sim import Fleet
from tests.conftest import running_router
from tests.sim.conftest import FAST
from tests.waiting import wait_for

EVENTS = dataclasses.replace(FAST, kv_events=True)
SYSTEM = " ".join(f"rule{i:03d} of conversation" for i in range(60))  # ~200 tokens


def metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v
                                           for k, v in labels.items()):
                total += sample.value
    return total


@contextlib.asynccontextmanager
async def two_routers(fleet: Fleet, **settings: object) -> AsyncIterator[list[str]]:
    async with running_router(fleet.urls, policy="kv-aware", tokenizer="sim",
                              **settings) as (a, _), running_router(
            fleet.urls, policy="kv-aware", tokenizer="sim", **settings) as (b, _):
        yield [a, b]


async def followed(session: aiohttp.ClientSession, url: str, replicas: int) -> bool:
    async with session.get(url + "/metrics") as resp:
        text = await resp.text()
    return metric(text, "dpserve_kv_events_following") == replicas


async def test_each_turn_goes_where_the_conversation_is_cached_whichever_router_takes_it():
    async with Fleet(n=4, config=EVENTS) as fleet, two_routers(fleet) as routers, \
            aiohttp.ClientSession() as s:
        for url in routers:
            await wait_for(lambda u=url: followed(s, u, 4),
                           what="each router following every replica's events")
        async with s.get(routers[0] + "/metrics") as resp:  # before any event: from 0
            first = await resp.text()
        for name in ("dpserve_kv_index_blocks", "dpserve_kv_event_gaps_total",
                     "dpserve_kv_event_lag_seconds", "dpserve_kv_event_resyncs_total"):
            assert {sample.labels["replica"] for family in text_string_to_metric_families(
                first) for sample in family.samples if sample.name == name} == {
                "r0", "r1", "r2", "r3"}, name
        for conversation in range(3):
            history = [{"role": "system", "content": f"{conversation} {SYSTEM}"}]
            served = []
            for turn in range(4):
                history.append({"role": "user", "content": f"question {turn} please"})
                async with s.post(routers[turn % 2] + "/v1/chat/completions", json={
                        "model": EVENTS.model, "messages": history,
                        "max_tokens": 8}) as resp:
                    assert resp.status == 200
                    body = await resp.json()
                    served.append(resp.headers["x-dpserve-replica"])
                history.append({"role": "assistant",
                                "content": body["choices"][0]["message"]["content"]})
            # The first turn lands anywhere; every later one where the first did, though
            # the two routers took turns and neither saw the other's choice.
            assert len(set(served)) == 1, served
        texts = []
        for url in routers:
            async with s.get(url + "/metrics") as resp:
                texts.append(await resp.text())
        for text in texts:  # 6 requests each; before any engine stored a block, the
            # first is the fallback's (no events yet), and says so
            events = metric(text, "dpserve_kv_routing_decisions_total", basis="events")
            assert events >= 5 and events + metric(
                text, "dpserve_kv_routing_decisions_total", basis="no_events") == 6
            assert metric(text, "dpserve_kv_routing_decisions_total", basis="no_tokens") == 0
            assert metric(text, "dpserve_kv_routed_tokens_total", kind="cached") > 0
            assert metric(text, "dpserve_kv_index_blocks") > 0


async def test_without_a_tokenizer_every_request_is_placed_by_the_fallback_and_counted():
    async with Fleet(n=2, config=EVENTS) as fleet, running_router(
            fleet.urls, policy="kv-aware") as (url, _), aiohttp.ClientSession() as s:
        for _ in range(3):
            async with s.post(url + "/v1/completions", json={
                    "model": EVENTS.model, "prompt": SYSTEM, "max_tokens": 4}) as resp:
                assert resp.status == 200
        async with s.get(url + "/metrics") as resp:
            text = await resp.text()
        assert metric(text, "dpserve_kv_routing_decisions_total", basis="no_tokens") == 3
        assert metric(text, "dpserve_kv_routing_decisions_total", basis="events") == 0


async def test_a_canary_window_compares_cache_hits_with_hits_by_what_the_engine_holds():
    """The canary's TTFTs are stratified by the prompt tokens its engine computed afresh:
    a conversation's first turn (its prefix nowhere yet) apart from the next turns
    (the prefix held by the engine, by its events)."""
    async with Fleet(n=2, config=EVENTS) as fleet, running_router(
            fleet.urls, policy="kv-aware", tokenizer="sim") as (url, router), \
            aiohttp.ClientSession() as s:
        await wait_for(lambda: followed(s, url, 2), what="the router following both replicas")
        assert router.kv is not None
        index = router.kv.index

        def blocks() -> int:
            stats = index.stats().get("r0")
            return 0 if stats is None else stats.blocks

        router.dispatcher.canary = CanarySplit("r0", 100)  # every first attempt to r0
        sent = []

        async def heard() -> bool:
            """Another unrelated prompt to r0, until its events reach the index (the
            first may be published before the subscription took)."""
            sent.append(len(sent))
            async with s.post(url + "/v1/completions", json={
                    "model": EVENTS.model, "prompt": f"unrelated {len(sent)} " * 40,
                    "max_tokens": 1}) as resp:
                assert resp.status == 200
            return blocks() > 0
        await wait_for(heard, what="r0's first events", within_s=20, every_s=0.2)
        split = router.dispatcher.canary = CanarySplit("r0", 100)
        history = [{"role": "system", "content": SYSTEM}]
        for turn in range(3):
            history.append({"role": "user", "content": f"question {turn} please"})
            before = blocks()
            async with s.post(url + "/v1/chat/completions", json={
                    "model": EVENTS.model, "messages": history, "max_tokens": 4}) as resp:
                assert resp.status == 200 and resp.headers["x-dpserve-replica"] == "r0"
                body = await resp.json()
            history.append({"role": "assistant",
                            "content": body["choices"][0]["message"]["content"]})
            await wait_for(lambda b=before: blocks() > b,
                           what="r0's events reporting the turn's blocks")
        work = [s % PER_BLOCK for s in split.canary.strata]
        assert len(work) == 3 and all(w >= 64 for w in work), work  # by tokens, not bytes
        assert work[0] > work[1] and work[0] > work[2], work  # the miss, apart
