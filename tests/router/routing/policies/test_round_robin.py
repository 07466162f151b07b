from __future__ import annotations

from dpserve.router.fleet.pool import Replica
from dpserve.router.routing.policies import RequestInfo, RoundRobin
from tests.router.routing.policies.fakes import replicas

INFO = RequestInfo(route="/v1/completions")


def test_round_robin_cycles_in_id_order():
    rr, pool = RoundRobin(), replicas(0, 0, 0)
    assert [rr.select(pool, INFO).id for _ in range(7)] == [
        "r0", "r1", "r2", "r0", "r1", "r2", "r0"]


def test_round_robin_keeps_its_turn_when_a_replica_leaves_rotation():
    rr, pool = RoundRobin(), replicas(0, 0, 0)
    assert rr.select(pool, INFO).id == "r0"
    assert rr.select([pool[0], pool[2]], INFO).id == "r2"  # r1 left: r2 is next, not r0
    assert rr.select(pool, INFO).id == "r0"


def test_round_robin_orders_ids_naturally():
    rr = RoundRobin()
    pool = [Replica(id=f"r{i}", url="u") for i in (10, 2, 1)]
    assert [rr.select(pool, INFO).id for _ in range(3)] == ["r1", "r2", "r10"]
