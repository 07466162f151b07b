"""Spreading by recent work: least sent lately, within the bounded-load cap."""

from __future__ import annotations

import pytest

from dpserve.router.routing.policies.recent_work import RecentWork, under_cap
from tests.router.routing.policies.fakes import replicas


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def send(spread: RecentWork, pool, n: int) -> list[str]:
    out = []
    for _ in range(n):
        chosen = spread.least(pool)
        spread.charge(chosen)
        out.append(chosen.id)
    return out


def test_equal_requests_go_round_in_id_order():
    pool = replicas(0, 0, 0)
    assert send(RecentWork(clock=Clock()), pool, 7) == ["r0", "r1", "r2", "r0", "r1", "r2", "r0"]


def test_a_replica_sent_extra_work_is_skipped_until_the_others_catch_up():
    pool = replicas(0, 0, 0)
    spread = RecentWork(clock=Clock())
    spread.charge(pool[0], units=2)
    assert send(spread, pool, 4) == ["r1", "r2", "r1", "r2"]


def test_old_work_fades_with_the_half_life():
    clock = Clock()
    spread = RecentWork(half_life_s=2.0, clock=clock)
    pool = replicas(0, 0)
    spread.charge(pool[0], units=4)
    clock.now += 4.0
    assert spread.work(pool[0], clock.now) == pytest.approx(1.0)
    spread.charge(pool[1], units=1.5)
    assert spread.least(pool).id == "r0"


def test_replicas_at_the_bounded_load_cap_are_left_out():
    pool = replicas(9, 3, 3, 1)  # 16 + 1 in flight over 4, twice the average: cap 9
    assert [r.id for r in under_cap(pool, 2.0)] == ["r1", "r2", "r3"]
    assert [r.id for r in under_cap(pool, 3.0)] == ["r0", "r1", "r2", "r3"]


def test_on_a_nearly_idle_fleet_the_cap_is_never_below_min_cap():
    pool = replicas(3, 0, 0, 0)  # bounded loads alone: capacity 2 at load factor 2
    assert [r.id for r in under_cap(pool, 2.0)] == ["r0", "r1", "r2", "r3"]
    pool[0].in_flight = 4
    assert [r.id for r in under_cap(pool, 2.0)] == ["r1", "r2", "r3"]


def test_a_half_life_must_be_positive():
    with pytest.raises(ValueError, match="half_life_s"):
        RecentWork(half_life_s=0)
