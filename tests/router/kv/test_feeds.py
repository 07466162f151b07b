"""The router follows each ready replica's KV events, and drops what it knew of one
the moment its cache can no longer be known (restart, hot-load, down, removed)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from dpserve.router.fleet.pool import Replica, ReplicaPool, ReplicaState
from dpserve.router.kv.feeds import KVEventFeeds
from dpserve.router.kv.sources import EventSource, override_source

SOURCES = {"0": {"enable_kv_cache_events": True, "publisher": "zmq",
                 "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "kv"}}


class Recorded:
    """Subscriptions that record what they are asked."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.closed = False

    def start(self, replica_id: str, source: EventSource) -> None:
        self.calls.append(("start", replica_id))

    def stop(self, replica_id: str) -> None:
        self.calls.append(("stop", replica_id))

    async def aclose(self) -> None:
        self.closed = True


def control(answers: dict[str, httpx.Response]) -> httpx.AsyncClient:
    def answer(request: httpx.Request) -> httpx.Response:
        return answers.get(request.url.host, httpx.Response(404))
    return httpx.AsyncClient(transport=httpx.MockTransport(answer))


async def settled(feeds: KVEventFeeds, replica_ids: list[str]) -> None:
    for _ in range(200):
        if all(r in feeds.status for r in replica_ids):
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"no status for {replica_ids}: {feeds.status}")


def fleet(n: int) -> tuple[ReplicaPool, list[Replica]]:
    replicas = [Replica(id=f"r{i}", url=f"http://10.0.0.{i}:8000") for i in range(n)]
    pool = ReplicaPool(replicas)
    for r in replicas:
        pool.set_state(r, ReplicaState.READY)
    return pool, replicas


async def test_each_ready_replica_publishing_events_is_followed_on_its_own_host():
    pool, _ = fleet(2)
    subs = Recorded()
    ok = httpx.Response(200, json=SOURCES)
    feeds = KVEventFeeds(pool, subs, control({"10.0.0.0": ok, "10.0.0.1": ok}))
    feeds.start()
    await settled(feeds, ["r0", "r1"])
    assert feeds.following == ["r0", "r1"]
    assert sorted(subs.calls) == [("start", "r0"), ("start", "r1")]
    await feeds.aclose()
    assert subs.closed


@pytest.mark.parametrize("state", [ReplicaState.STARTING, ReplicaState.RELOADING,
                                   ReplicaState.DOWN])
async def test_a_restart_hot_load_or_outage_drops_the_replica_and_ready_follows_it_again(state):
    pool, (r0,) = fleet(1)
    subs = Recorded()
    feeds = KVEventFeeds(pool, subs, control({"10.0.0.0": httpx.Response(200, json=SOURCES)}))
    feeds.start()
    await settled(feeds, ["r0"])
    pool.set_state(r0, state)
    assert subs.calls == [("start", "r0"), ("stop", "r0")] and feeds.following == []
    pool.set_state(r0, ReplicaState.READY)
    for _ in range(200):
        if feeds.following == ["r0"]:
            break
        await asyncio.sleep(0.005)
    assert subs.calls[-1] == ("start", "r0")
    await feeds.aclose()


async def test_a_draining_replica_stays_followed():
    pool, (r0,) = fleet(1)
    subs = Recorded()
    feeds = KVEventFeeds(pool, subs, control({"10.0.0.0": httpx.Response(200, json=SOURCES)}))
    feeds.start()
    await settled(feeds, ["r0"])
    pool.set_state(r0, ReplicaState.DRAINING)
    assert subs.calls == [("start", "r0")]
    await feeds.aclose()


async def test_a_replica_removed_from_the_pool_is_dropped():
    pool, _ = fleet(1)
    subs = Recorded()
    feeds = KVEventFeeds(pool, subs, control({"10.0.0.0": httpx.Response(200, json=SOURCES)}))
    feeds.start()
    await settled(feeds, ["r0"])
    pool.remove("r0", "left the fleet")
    assert ("stop", "r0") in subs.calls and "r0" not in feeds.status
    await feeds.aclose()


@pytest.mark.parametrize("response, status", [
    (httpx.Response(200, json={}), "not published"),
    (httpx.Response(404), "not offered"),
    (httpx.Response(500), "answered 500"),
    (httpx.Response(200, content=b"x" * 70_000), "over"),
    (httpx.Response(200, json={"0": SOURCES["0"] | {"endpoint": "tcp://10.9.9.9:1"}}),
     "names a host"),
])
async def test_a_replica_that_publishes_nothing_usable_says_why_and_is_not_followed(
        response, status, caplog):
    pool, _ = fleet(1)
    subs = Recorded()
    feeds = KVEventFeeds(pool, subs, control({"10.0.0.0": response}))
    feeds.start()
    await settled(feeds, ["r0"])
    assert status in feeds.status["r0"] and subs.calls == []
    assert "routed by the fallback policy" in caplog.text
    await feeds.aclose()


async def test_the_override_is_used_without_asking_the_replica():
    pool, _ = fleet(1)
    subs = Recorded()
    feeds = KVEventFeeds(pool, subs, control({}),
                         override=lambda url: override_source("tcp://*:7000", None, "kv", url))
    feeds.start()
    await settled(feeds, ["r0"])
    assert feeds.status == {"r0": "following"} and subs.calls == [("start", "r0")]
    await feeds.aclose()
