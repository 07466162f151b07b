"""Leader and follower over a real socket pair, in one process: what a follower routes
by is the leader's table, and what it holds counts on the leader."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

from dpserve.config import RouterConfig
from dpserve.router.fleet.adapters import AdapterVersion
from dpserve.router.fleet.breaker import Outcome
from dpserve.router.fleet.live import Moving
from dpserve.router.fleet.pool import Replica, ReplicaPool, ReplicaState
from dpserve.router.http.app import Router, build_app
from dpserve.router.routing.canary import PER_BLOCK, CanarySplit, stratum
from dpserve.router.routing.policies import RequestInfo
from dpserve.router.workers.follower import Follower
from dpserve.router.workers.leader import Leader, answer
from dpserve.router.workers.wire import Channel
from dpserve.router.workers.work_table import WorkTable
from tests.waiting import wait_for

REQUEST = RequestInfo(route="/v1/completions")


@contextlib.asynccontextmanager
async def leader_and_follower(replicas: int = 2, *, shared_work: bool = False,
                              leader_app: Any = None
                              ) -> AsyncIterator[tuple[Router, Leader, Router, Follower]]:
    """`leader_app`: what answers relayed requests on the leader (default its router's)."""
    pool = ReplicaPool([Replica(id=f"r{i}", url=f"http://127.0.0.1:{9 + i}", weight_version="v1")
                        for i in range(replicas)])
    for replica in pool:
        pool.set_state(replica, ReplicaState.READY)
    table = WorkTable.create(2) if shared_work else None
    lead = Router(pool, RouterConfig())
    leader = Leader(lead, leader_app or build_app(lead), table)
    follow = Router(ReplicaPool([]), RouterConfig())
    ours, theirs = socket.socketpair()
    follower = Follower(follow, await Channel.open(theirs),
                        WorkTable(table.fd, workers=2, me=1) if table is not None else None)
    leader.attach(1, await Channel.open(ours))
    following = asyncio.create_task(follower.run())
    await wait_for(follower.has_table.is_set, "the first table")
    try:
        yield lead, leader, follow, follower
    finally:
        await leader.aclose()
        following.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await following
        await lead.aclose()
        await follow.aclose()
        if table is not None:
            os.close(table.fd)


def _replica(router: Router, replica_id: str) -> Replica:
    replica = router.pool.get(replica_id)
    assert replica is not None
    return replica


async def test_the_follower_routes_by_the_leaders_table():
    async with leader_and_follower() as (lead, leader, follow, _):
        assert [(r.id, r.state, r.weight_version) for r in follow.pool] == [
            ("r0", ReplicaState.READY, "v1"), ("r1", ReplicaState.READY, "v1")]
        lead.pool.set_state(_replica(lead, "r0"), ReplicaState.DRAINING, "drained by admin")
        await leader.settled()  # returns once the follower applied it
        assert _replica(follow, "r0").state is ReplicaState.DRAINING
        slots = [await follow.dispatcher.choose(REQUEST, ()) for _ in range(4)]
        assert {s.replica.id for s in slots} == {"r1"}


async def test_requests_held_by_the_follower_count_on_the_leader_and_back():
    async with leader_and_follower() as (lead, _, follow, _):
        held = await follow.dispatcher.choose(REQUEST, ())
        with held:
            replica_id = held.replica.id
            await wait_for(lambda: _replica(lead, replica_id).in_flight == 1,
                           "the follower's request counted on the leader")
            mine = await lead.dispatcher.choose(REQUEST, ())
            with mine:
                await wait_for(lambda: sum(r.in_flight for r in follow.pool) == 2,
                               "the leader's request counted on the follower")
        await wait_for(lambda: all(r.in_flight == 0 for r in (*lead.pool, *follow.pool)),
                       "every count back to 0")


async def test_a_drain_waits_for_the_followers_requests_on_the_replica():
    async with leader_and_follower() as (lead, _, follow, _):
        held = await follow.dispatcher.choose(REQUEST, ())
        replica = _replica(lead, held.replica.id)
        with held:
            lead.pool.set_state(replica, ReplicaState.DRAINING)
            assert await lead.pool.wait_idle(replica, 0.3) is False
        assert await lead.pool.wait_idle(replica, 5) is True


async def test_a_follower_that_goes_away_stops_counting():
    async with leader_and_follower() as (lead, leader, follow, _):
        held = await follow.dispatcher.choose(REQUEST, ())
        held.__enter__()
        await wait_for(lambda: sum(r.in_flight for r in lead.pool) == 1, "counted")
        await leader.detach(1)
        assert sum(r.in_flight for r in lead.pool) == 0


async def test_a_replica_the_follower_finds_down_goes_down_on_the_leader():
    async with leader_and_follower() as (lead, _, follow, _):
        follow.pool.mark_down(_replica(follow, "r1"), "connection failed: refused")
        await wait_for(lambda: _replica(lead, "r1").state is ReplicaState.DOWN, "r1 down")
        assert _replica(lead, "r1").last_error == "connection failed: refused"


async def test_canary_outcomes_seen_by_the_follower_reach_the_leaders_comparison():
    async with leader_and_follower() as (lead, leader, follow, _):
        split = CanarySplit("r0", 20.0, baseline_id="r1", baseline_weight_pct=20.0)
        lead.dispatcher.canary = split
        await leader.settled()
        mirrored = follow.dispatcher.canary
        assert mirrored is not None and mirrored.spec() == split.spec()
        assert mirrored.opened == split.opened  # one window, one clock: the same strata
        mirrored.record("r0", Outcome.SERVER_ERROR, None)
        mirrored.record("r1", Outcome.SUCCESS, 0.25, 5000)
        mirrored.record("r2", Outcome.SUCCESS, 0.5)
        await wait_for(lambda: (split.canary.requests, split.baseline.requests,
                                split.others.requests) == (1, 1, 1),
                       "the follower's samples on the leader")
        assert split.canary.errors == 1 and split.baseline.first_byte_s == [0.25]
        [got] = split.baseline.strata  # its size, and a time block of the window so far
        assert got % PER_BLOCK == stratum(0, 5000) and got <= stratum(
            time.monotonic() - split.opened, 5000)
        assert split.others.first_byte_s == [0.5]


async def test_evicting_a_replica_moves_the_followers_streams_too():
    class Stream:
        interrupted: list[BaseException] = []

        def interrupt(self, error: BaseException) -> None:
            self.interrupted.append(error)

    async with leader_and_follower() as (lead, _, follow, _):
        started: Any = Stream()
        waiting: Any = Stream()  # no first chunk yet: it would start over
        streams = follow.dispatcher.streams
        with streams.running("r0", started, lambda: True), \
                streams.running("r0", waiting, lambda: True, restarts=True):
            await wait_for(lambda: lead.dispatcher.streams.movable("r0").total == 2,
                           "the follower's movable streams seen by the leader")
            assert lead.dispatcher.streams.evict("r0") == Moving(migrating=1, restarting=1)
            await wait_for(lambda: len(Stream.interrupted) == 2,
                           "the follower's streams interrupted")


async def test_adapters_mirror_and_a_retiring_version_waits_for_the_followers_leases():
    async with leader_and_follower() as (lead, leader, follow, _):
        v1 = AdapterVersion(name="sql", version="1", path="/a/1", rank=8, replicas={"r0"})
        lead.adapters.add(v1)
        lead.adapters.switch(v1)
        await leader.settled()
        mirrored = follow.adapters.resolve("sql")
        assert mirrored is not None and mirrored.engine_name == "sql@1"
        with follow.adapters.lease(mirrored):
            await wait_for(lambda: v1.in_flight == 1, "the follower's lease on the leader")
        await wait_for(lambda: v1.in_flight == 0, "the lease given back")


async def test_a_relayed_admin_request_is_checked_as_the_leaders_own():
    async with leader_and_follower() as (lead, _, _, _):
        app = build_app(lead)

        def relayed(client: str) -> dict[str, Any]:
            return {"scope": {"http_version": "1.1", "method": "GET", "scheme": "http",
                              "path": "/admin/replicas", "query_string": "", "headers": [],
                              "client": [client, 5000], "server": ["127.0.0.1", 8000]},
                    "body": ""}

        remote, _, _ = await answer(app, relayed("10.1.2.3"))
        local, _, body = await answer(app, relayed("127.0.0.1"))
    assert remote == 403  # no admin key: loopback clients only, and this one is not
    assert local == 200 and b"r0" in body


async def test_prefix_homes_and_recent_work_are_shared_between_workers():
    async with leader_and_follower() as (lead, _, follow, _):
        tenant = RequestInfo(route="/v1/completions", prefix="You are the billing assistant.")
        with await follow.dispatcher.choose(REQUEST, ()) as first:  # no prefix: spread
            pass
        with await follow.dispatcher.choose(tenant, ()) as home:  # the least-worked replica
            pass
        assert first.replica.id != home.replica.id

        async def leader_picks_the_home() -> bool:
            with await lead.dispatcher.choose(tenant, ()) as slot:
                return slot.replica.id == home.replica.id
        # Alone, the leader would give the key a home of its own: the replica it sent
        # least to, r0 (the follower's first request is work it cannot see).
        await wait_for(leader_picks_the_home, "the leader to learn the follower's home")


async def test_with_the_shared_work_table_workers_spread_as_one_process_would():
    async with leader_and_follower(8, shared_work=True) as (lead, _, follow, _):
        picks = []
        for i in range(32):  # no await between picks: no message could carry them
            router = (lead, follow)[i % 3 == 0]
            with await router.dispatcher.choose(
                    RequestInfo(route="/v1/completions", prefix=f"prompt {i}"), ()) as slot:
                picks.append(slot.replica.id)
    assert all(picks[i] not in picks[i - 7:i] for i in range(7, 32)), picks  # round robin


async def test_ready_waits_for_a_follower_whose_table_had_no_replica_ready():
    """A follower serving on a table from before the pool was ready would refuse every
    request it takes, so /ready (what a load balancer sends traffic by) waits for it."""
    pool = ReplicaPool([Replica(id="r0", url="http://127.0.0.1:9", weight_version="v1")])
    lead = Router(pool, RouterConfig())
    app = build_app(lead)
    leader = Leader(lead, app)
    ours, theirs = socket.socketpair()
    leader.attach(1, await Channel.open(ours))  # attached while nothing is ready
    probe = {"scope": {"http_version": "1.1", "method": "GET", "scheme": "http",
                       "path": "/ready", "query_string": "", "headers": [],
                       "client": ["127.0.0.1", 5000], "server": ["127.0.0.1", 8000]},
             "body": ""}
    follow = Router(ReplicaPool([]), RouterConfig())
    follower = Follower(follow, await Channel.open(theirs))
    try:
        pool.set_state(_replica(lead, "r0"), ReplicaState.READY)
        status, _, body = await answer(app, probe)  # the follower has applied nothing
        assert status == 503 and b"worker(s) [1]" in body
        following = asyncio.create_task(follower.run())
        await wait_for(lambda: _replica_ready(follow), "the follower sees r0 ready")

        async def ready() -> bool:
            return (await answer(app, probe))[0] == 200
        await wait_for(ready, "/ready once the follower caught up")
    finally:
        await leader.aclose()
        with contextlib.suppress(NameError, asyncio.CancelledError):
            following.cancel()
            await following
        await lead.aclose()
        await follow.aclose()


def _replica_ready(router: Router) -> bool:
    replica = router.pool.get("r0")
    return replica is not None and replica.state is ReplicaState.READY
