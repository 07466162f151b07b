from __future__ import annotations

import random

import pytest

from dpserve.router.policies import LeastOutstanding, RequestInfo, RoundRobin, make_policy
from dpserve.router.pool import Replica

INFO = RequestInfo(route="/v1/completions")


def replicas(*loads: int) -> list[Replica]:
    return [Replica(id=f"r{i}", url=f"http://r{i}", in_flight=n) for i, n in enumerate(loads)]


def test_least_outstanding_picks_the_replica_with_fewest_in_flight():
    pool = replicas(3, 1, 2)
    assert LeastOutstanding().select(pool, INFO).id == "r1"


def test_least_outstanding_breaks_ties_at_random_between_the_least_loaded_only():
    pool = replicas(0, 5, 0, 0)
    chosen = {LeastOutstanding(rng=random.Random(seed)).select(pool, INFO).id
              for seed in range(50)}
    assert chosen == {"r0", "r2", "r3"}


def test_least_outstanding_with_a_seeded_rng_is_reproducible():
    pool = replicas(0, 0, 0)
    a = [LeastOutstanding(rng=random.Random(7)).select(pool, INFO).id for _ in range(5)]
    b = [LeastOutstanding(rng=random.Random(7)).select(pool, INFO).id for _ in range(5)]
    assert a == b


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


@pytest.mark.parametrize("policy", [LeastOutstanding(), RoundRobin()])
def test_no_candidates_means_no_choice(policy):
    assert policy.select([], INFO) is None


def test_policies_are_built_by_name():
    assert make_policy("round-robin").name == "round-robin"
    assert make_policy("least-outstanding").name == "least-outstanding"
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("fastest")
