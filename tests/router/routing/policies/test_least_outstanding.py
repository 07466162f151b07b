from __future__ import annotations

import random
from collections import Counter

from dpserve.router.routing.policies import LeastOutstanding, RequestInfo
from tests.router.routing.policies.fakes import ScriptedRandom, replicas

INFO = RequestInfo(route="/v1/completions")


def test_of_the_two_drawn_the_one_with_fewer_in_flight_wins():
    pool = replicas(3, 1, 2, 0)
    policy = LeastOutstanding(rng=ScriptedRandom((0, 1), (2, 0), (1, 3)))
    assert [policy.select(pool, INFO).id for _ in range(3)] == ["r1", "r2", "r3"]


def test_a_tie_goes_to_the_first_drawn():
    pool = replicas(2, 2, 2)
    policy = LeastOutstanding(rng=ScriptedRandom((2, 0), (1, 2)))
    assert [policy.select(pool, INFO).id for _ in range(2)] == ["r2", "r1"]


def test_the_two_drawn_are_always_distinct_replicas():
    pool = replicas(0, 1)  # with two candidates the less loaded one always wins
    policy = LeastOutstanding(rng=random.Random(3))
    assert {policy.select(pool, INFO).id for _ in range(100)} == {"r0"}


def test_the_busiest_replica_is_never_chosen_and_idle_ones_share_the_load():
    pool = replicas(0, 0, 0, 9)
    policy = LeastOutstanding(rng=random.Random(1))
    chosen = Counter(policy.select(pool, INFO).id for _ in range(3000))
    assert "r3" not in chosen
    assert all(800 < chosen[r] < 1200 for r in ("r0", "r1", "r2")), chosen


def test_a_single_candidate_is_chosen_without_drawing():
    pool = replicas(5)
    assert LeastOutstanding(rng=ScriptedRandom()).select(pool, INFO).id == "r0"


def test_a_seeded_rng_makes_choices_reproducible():
    pool = replicas(0, 0, 0, 0)
    a = LeastOutstanding(rng=random.Random(7))
    b = LeastOutstanding(rng=random.Random(7))
    assert [a.select(pool, INFO).id for _ in range(20)] == [
        b.select(pool, INFO).id for _ in range(20)]
