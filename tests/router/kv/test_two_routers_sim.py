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
