from __future__ import annotations

from collections import Counter

import pytest

from dpserve.router.routing.policies.consistent_hash import (
    BoundedLoadHash,
    HashRing,
    capacity,
    stable_hash,
)
from tests.router.routing.policies.fakes import replicas

KEYS = [f"key-{i}" for i in range(4000)]


def placements(hasher: BoundedLoadHash, pool, keys=KEYS) -> dict[str, str]:
    return {k: hasher.select(pool, k).id for k in keys}


def test_the_hash_is_fixed_so_keys_map_alike_in_every_process_and_release():
    # Changing the function would move every session at the next deploy.
    assert stable_hash("session-1") == 12558777036138866604


@pytest.mark.parametrize(("in_flight", "n", "factor", "cap"), [
    (0, 4, 1.25, 1),    # an idle fleet: every replica may take one
    (7, 4, 1.25, 3),    # 8 with the new one, 2 on average, 2.5 allowed -> 3
    (11, 4, 1.0, 3),    # no slack: exactly the average
    (9, 1, 1.1, 11),    # 1.1 * 10 is 11.000000000000002 in floats: still 11
])
def test_capacity_is_the_rounded_up_bound_on_the_average_including_the_new_request(
        in_flight, n, factor, cap):
    assert capacity(in_flight, n, factor) == cap


def test_the_same_key_goes_to_the_same_replica_whatever_the_instance_or_order():
    pool = replicas(0, 0, 0, 0)
    first = placements(BoundedLoadHash(), pool)
    assert placements(BoundedLoadHash(), list(reversed(pool))) == first
    assert len(set(first.values())) == 4


def test_keys_spread_roughly_evenly_over_replicas():
    shares = Counter(placements(BoundedLoadHash(), replicas(0, 0, 0, 0)).values())
    assert all(0.2 < shares[r] / len(KEYS) < 0.3 for r in ("r0", "r1", "r2", "r3")), shares


def test_removing_a_replica_moves_only_the_keys_it_held():
    pool = replicas(0, 0, 0, 0)
    hasher = BoundedLoadHash()
    before = placements(hasher, pool)
    after = placements(hasher, [r for r in pool if r.id != "r2"])
    moved = {k for k in KEYS if before[k] != after[k]}
    assert moved == {k for k in KEYS if before[k] == "r2"}
    assert Counter(after[k] for k in moved).keys() == {"r0", "r1", "r3"}  # spread, not dumped


def test_a_subset_of_the_ring_answers_like_a_ring_built_without_the_others():
    pool = replicas(0, 0, 0, 0)
    warm = BoundedLoadHash()
    placements(warm, pool)  # ring now holds r0..r3
    subset = [pool[0], pool[3]]
    assert placements(warm, subset) == placements(BoundedLoadHash(), subset)


def test_adding_a_replica_moves_about_one_key_in_n_and_only_onto_the_newcomer():
    hasher = BoundedLoadHash()
    before = placements(hasher, replicas(0, 0, 0, 0))
    after = placements(hasher, replicas(0, 0, 0, 0, 0))
    moved = [k for k in KEYS if before[k] != after[k]]
    assert {after[k] for k in moved} == {"r4"}
    assert 0.12 < len(moved) / len(KEYS) < 0.28  # 1/5 expected


def test_a_hot_key_stays_home_until_its_replica_reaches_the_bound_then_spills_clockwise():
    pool = replicas(2, 2, 2, 2)
    walk = list(HashRing(r.id for r in pool).walk(stable_hash("hot")))
    home, second = (next(r for r in pool if r.id == rid) for rid in walk[:2])
    hasher = BoundedLoadHash(load_factor=1.25)
    # 8 + 3 on home + the new one = 12 over 4 -> 3.75 allowed -> capacity 4
    home.in_flight = 5
    assert capacity(sum(r.in_flight for r in pool), 4, 1.25) == 4
    assert hasher.select(pool, "hot") is second
    home.in_flight = 3
    assert hasher.select(pool, "hot") is home


def test_under_a_flood_of_one_key_its_home_keeps_the_most_but_never_beyond_the_bound():
    pool = replicas(0, 0, 0, 0)
    home = next(iter(HashRing(r.id for r in pool).walk(stable_hash("hot"))))
    hasher = BoundedLoadHash(load_factor=1.25)
    for placed in range(100):
        hasher.select(pool, "hot").in_flight += 1  # the lease is held: load accumulates
        assert max(r.in_flight for r in pool) <= capacity(placed, 4, 1.25)
    assert max(pool, key=lambda r: r.in_flight).id == home
    assert max(r.in_flight for r in pool) == 32  # 1.25 * 100 / 4, rounded up


def test_the_walk_visits_each_replica_once():
    ring = HashRing(["a", "b", "c"], vnodes=50)
    assert sorted(ring.walk(stable_hash("x"))) == ["a", "b", "c"]
    assert list(HashRing([]).walk(1)) == []


def test_nonsense_settings_are_refused():
    with pytest.raises(ValueError, match="load_factor"):
        BoundedLoadHash(load_factor=0.9)
    with pytest.raises(ValueError, match="vnodes"):
        HashRing(["a"], vnodes=0)
