"""What a router's data-plane workers share for `kv-aware` (`dpserve.router.workers.kv_share`):
the prompts each placed, forecast by every other; with peers, the peers' view, which
only the leader hears and relays in its table. End to end, with processes:
tests/router/kv/test_workers_sim.py and tests/router/peers/test_peers_sim.py."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

from dpserve.config import RouterConfig
from dpserve.router.fleet.pool import Replica
from dpserve.router.kv.index import KVIndex, prompt_keys
from dpserve.router.peers.state import PeerState
from dpserve.router.routing.policies import PrefixAffinity, RequestInfo
from dpserve.router.routing.policies.kv_aware import KVAware
from dpserve.router.workers.kv_share import (
    FollowerShare,
    LeaderShare,
    follower_config,
)
from dpserve.router.workers.wire import Message, apply_row, new_replica, replica_row
from tests.router.peers.test_state import TENANT, A, B, Clock, known, pool, report


def kv_router(replicas: Any, clock: Clock, *, peered: bool = False) -> Any:
    """What the shares read of a `Router`: its pool, its policy and its peer link (with
    `peered`, whose state hears as A)."""
    index = KVIndex()
    known(index, replicas)
    policy = KVAware(index, fallback=PrefixAffinity(clock=clock), forecast=index.forecast(),
                     clock=clock)
    link = None
    if peered:
        link = SimpleNamespace(state=PeerState(replicas, sender=A, index=index,
                                               forecast=policy.forecast, clock=clock,
                                               half_life_s=2.0))
        policy.take_sent()  # as a peer link: keep what is placed, for the next report
    return SimpleNamespace(pool=replicas, policy=policy, peers=link)


def wire(message: Message) -> Message:
    """As it crosses the socket pair."""
    return json.loads(json.dumps(message))  # type: ignore[no-any-return]


def place(router: Any, tokens: tuple[int, ...]) -> str:
    chosen = router.policy.select(list(router.pool), RequestInfo(route="/v1/completions",
                                                                 tokens=tokens))
    assert chosen is not None
    return chosen.id  # type: ignore[no-any-return]


async def test_a_prompt_one_worker_placed_draws_another_workers_request_with_its_prefix():
    clock = Clock()
    replicas = [pool(4) for _ in range(3)]  # each worker's own mirror of the pool
    leader, one, two = (kv_router(r, clock) for r in replicas)
    to_leader: list[Message] = []
    broadcast: list[tuple[Message, object | None]] = []
    lead = LeaderShare(leader, lambda m, source: broadcast.append((wire(m), source)),
                       clock=clock)
    FollowerShare(one, lambda m: to_leader.append(wire(m)), clock=clock)
    other = FollowerShare(two, lambda m: None, clock=clock)
    for router in (one, two):  # each worker spreads new work its own way: others first
        for _ in range(2):
            router.policy.fallback.send(next(r for r in router.pool if r.id == "r0"))
    home = place(one, TENANT + (7,) * 8)
    assert home != "r0" and not to_leader  # sent at the end of the loop's turn
    await asyncio.sleep(0)
    (message,) = to_leader
    lead.absorb(message, "worker 1")
    assert broadcast == [(message, "worker 1")]  # to every follower but its own
    other.absorb(broadcast[0][0])
    for router in (leader, two):
        assert place(router, TENANT + (9,) * 8) == home
        assert router.policy.stats.relayed_prompts == 1
        assert router.policy.stats.last_cached_tokens == 0  # no event said so: the forecast


async def test_the_leader_tells_peers_what_its_workers_placed_and_its_workers_what_peers_did():
    clock = Clock()
    leader = kv_router(pool(4), clock, peered=True)
    broadcast: list[Message] = []
    share = LeaderShare(leader, lambda m, source: broadcast.append(wire(m)), clock=clock)
    keys = tuple(prompt_keys(TENANT, None, 4))
    share.absorb(wire({"op": "prompts", "prompts": [["http://10.0.0.3:8000", 4, list(keys)]]}),
                 "worker 1")
    assert leader.policy.take_sent() == [("http://10.0.0.3:8000", 4, keys)]  # to peers
    broadcast.clear()
    leader.peers.state.receive(report(B, 0, pending=(("http://10.0.0.2:8000", 4, keys),)))
    await asyncio.sleep(0)
    assert broadcast == [{"op": "prompts", "prompts": [["http://10.0.0.2:8000", 4,
                                                         list(keys)]]}]


def test_a_followers_view_of_the_peers_is_the_leaders():
    clock = Clock()
    replicas = pool(4)
    leader = kv_router(replicas, clock, peered=True)
    state = leader.peers.state
    state.receive(report(B, 0, {"http://10.0.0.1:8000": 3},
                         work={"http://10.0.0.0:8000": 4.0, "http://10.0.0.1:8000": 1.0}))
    clock.now += 0.5
    state.receive(report(b"c" * 16, 0, work={"http://10.0.0.0:8000": 2.0}))
    section = LeaderShare(leader, lambda m, s: None, clock=clock).table_section()
    assert section is not None
    follower = kv_router(pool(4), clock)
    share = FollowerShare(follower, lambda m: None, clock=clock)
    share.apply(wire(section))
    seen = follower.policy.fallback.peers
    assert seen is not None
    for later in (0.0, 0.7, 5.0):
        now = clock.now + later
        for r in replicas:
            assert abs(seen.work(r.url, now) - state.work(r.url, now)) < 1e-9
            assert seen.bias(r.url) == state.bias(r.url)
    assert sorted(seen.bias(r.url) for r in replicas) == [0.0, 0.0, 1.0, 1.0]  # 3 routers
    share.apply(None)
    assert follower.policy.fallback.peers is None


def test_a_follower_routes_by_the_peers_in_flight_and_never_holds_the_peer_key():
    leader_side = Replica(id="r0", url="http://10.0.0.0:8000")
    leader_side.peer_in_flight, leader_side.engine_peer_in_flight_at_scrape = 5, 3
    mirror = new_replica(wire(replica_row(leader_side, 0, 0)))
    apply_row(mirror, wire(replica_row(leader_side, 0, 0)))
    assert (mirror.peer_in_flight, mirror.engine_peer_in_flight_at_scrape) == (5, 3)
    config = RouterConfig(peers=["10.0.0.9:5560"],
                          peer_bind="0.0.0.0:5560", peer_key="k" * 40, workers=2)
    mine = follower_config(config)
    assert (mine.peers, mine.peer_bind, mine.peer_key, mine.peer_key_file) == (
        None, None, None, None)
    assert mine.workers == 2 and mine.port == config.port
