from __future__ import annotations

import random

import pytest

from dpserve.router.fleet.engine_metrics import EngineLoad
from dpserve.router.fleet.pool import Replica, ReplicaPool
from dpserve.router.routing.policies import EngineLoadPolicy, RequestInfo
from tests.router.routing.policies.fakes import ScriptedRandom, replicas

INFO = RequestInfo(route="/v1/completions")


class FakeClock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def scraped(replica: Replica, *, running: int = 0, waiting: int = 0, kv: float = 0.0,
            at: float = 100.0) -> Replica:
    ReplicaPool([replica]).record_engine_load(
        replica, EngineLoad(num_requests_running=running, num_requests_waiting=waiting,
                            kv_cache_usage_perc=kv), at)
    return replica


def test_without_a_scrape_the_score_is_the_routers_own_count():
    (r,) = replicas(3)
    assert EngineLoadPolicy().score(r, 100.0) == 3.0


def test_the_score_adds_queued_requests_twice_and_weighs_the_kv_cache():
    (r,) = replicas(0)
    scraped(r, running=4, waiting=2, kv=0.5)
    # queue 6, waiting 2 more, kv 0.5 * 2
    assert EngineLoadPolicy(waiting_weight=1.0, kv_weight=2.0).score(r, 100.0) == 9.0


def test_what_the_router_sent_since_the_scrape_counts_at_once():
    (r,) = replicas(2)
    scraped(r, running=5)  # 2 of ours, 3 from elsewhere
    r.in_flight = 6
    assert EngineLoadPolicy().score(r, 101.0) == 9.0
    r.in_flight = 0  # ours finished; the other 3 may still run
    assert EngineLoadPolicy().score(r, 101.0) == 3.0


def test_the_routers_own_count_is_a_floor_under_a_lagging_scrape():
    (r,) = replicas(0)
    scraped(r, running=0)
    r.in_flight = 4  # sent since the scrape and more: the engine cannot hold fewer
    assert EngineLoadPolicy().score(r, 100.0) == 4.0


def test_a_stale_scrape_is_ignored():
    (r,) = replicas(1)
    scraped(r, running=50, at=100.0)
    policy = EngineLoadPolicy(max_age_s=10.0)
    assert policy.score(r, 110.0) == 50.0  # just fresh enough
    assert policy.score(r, 110.1) == 1.0


def test_of_the_two_drawn_the_lower_score_wins():
    pool = replicas(0, 0, 0)
    scraped(pool[0], running=3)
    scraped(pool[1], waiting=1)  # 1 queued + 1 extra for waiting = 2
    policy = EngineLoadPolicy(clock=FakeClock(), rng=ScriptedRandom((0, 1), (2, 0), (1, 2)))
    assert [policy.select(pool, INFO).id for _ in range(3)] == ["r1", "r2", "r2"]


def test_a_burst_does_not_herd_onto_the_replica_an_old_scrape_showed_idle():
    idle, busy = replicas(0, 0)
    scraped(idle, running=0)
    scraped(busy, running=4)
    policy = EngineLoadPolicy(clock=FakeClock(), rng=random.Random(0))
    for _ in range(10):
        policy.select([idle, busy], INFO).in_flight += 1  # leases held, no new scrape
    assert (idle.in_flight, busy.in_flight) == (7, 3)  # 7 == 4 + 3: level, not 10 and 0


@pytest.mark.parametrize("n", [0, 1])
def test_small_candidate_lists_need_no_draw(n):
    pool = replicas(*[0] * n)
    chosen = EngineLoadPolicy(rng=ScriptedRandom()).select(pool, INFO)
    assert chosen is (pool[0] if n else None)
