"""Adapter affinity: requests for a LoRA adapter go where it is active, then where a
slot is free, then behind the least work of other adapters; a hot one spreads."""

from __future__ import annotations

from collections import Counter

import pytest

from dpserve.router.fleet.engine_metrics import EngineLoad
from dpserve.router.fleet.pool import Replica
from dpserve.router.routing.policies import AdapterAffinity, PrefixAffinity, RequestInfo, RoundRobin
from tests.router.routing.policies.fakes import replicas

ROUTE = "/v1/completions"
NOW = 1000.0
WALL = 1.8e9


def ask(adapter: str | None, prefix: str | None = None) -> RequestInfo:
    return RequestInfo(route=ROUTE, model=adapter.split("@")[0] if adapter else "tiny",
                       adapter=adapter, prefix=prefix)


def running(replica: Replica, **counts: int) -> None:
    """Requests in flight on `replica`, per adapter (names with `_` for `@`)."""
    for name, n in counts.items():
        replica.adapters_in_flight[name.replace("_", "@")] = n
        replica.in_flight += n


def affinity(slots: int = 1, **kw) -> AdapterAffinity:  # type: ignore[no-untyped-def]
    return AdapterAffinity(RoundRobin(), max_loras=slots, clock=lambda: NOW,
                           wall_clock=lambda: WALL, **kw)


def reported(replica: Replica, *, running_: set[str] = frozenset(),  # type: ignore[assignment]
             waiting: set[str] = frozenset(), slots: int | None = None,  # type: ignore[assignment]
             scraped_ago: float = 0.5, reported_ago: float = 0.5) -> None:
    replica.engine = EngineLoad(lora_running=frozenset(running_),
                                lora_waiting=frozenset(waiting), max_loras=slots,
                                lora_at=WALL - reported_ago)
    replica.engine_scraped_at = NOW - scraped_ago


def test_a_request_goes_where_its_adapter_is_running_though_the_other_replica_is_idle():
    pool = replicas(0, 0)
    running(pool[1], a_1=3)
    policy = affinity()
    assert {policy.select(pool, ask("a@1")).id for _ in range(6)} == {"r1"}


def test_a_new_adapter_takes_a_free_slot_rather_than_wait_behind_another():
    pool = replicas(0, 0, 0)
    running(pool[0], a_1=1)
    running(pool[2], b_1=1)
    assert affinity().select(pool, ask("c@1")).id == "r1"


def test_with_every_slot_taken_it_waits_behind_the_least_work_of_other_adapters():
    pool = replicas(0, 0)
    running(pool[0], a_1=2)
    running(pool[1], b_1=1)
    assert affinity().select(pool, ask("c@1")).id == "r1"


def test_more_slots_hold_more_adapters_side_by_side():
    pool = replicas(0, 0)
    running(pool[0], a_1=1)
    running(pool[1], b_1=1, c_1=1)
    assert affinity(slots=2).select(pool, ask("d@1")).id == "r0"


def test_a_hot_adapter_spreads_once_its_replica_carries_more_than_its_share():
    pool = replicas(0, 0)
    running(pool[0], a_1=12)  # 1.5 x the average (6.5 with the new one) is 10
    assert affinity().select(pool, ask("a@1")).id == "r1"
    running(pool[1], a_1=1)
    chosen = Counter(affinity().select(pool, ask("a@1")).id for _ in range(4))
    assert chosen == {"r1": 4}  # r1 is where it runs now and is under the cap


def test_versions_of_one_adapter_are_different_adapters_to_the_engine():
    pool = replicas(0, 0)
    running(pool[0], a_1=1)
    running(pool[1], b_1=1)
    # a@2 is a new version: no replica has it active, so neither is preferred for it
    # by a@1's requests; it waits behind the least other work (a tie: both).
    assert affinity().preferred(pool, "a@2") == pool


def test_requests_for_the_base_model_are_placed_by_the_configured_policy_alone():
    pool = replicas(0, 0)
    running(pool[0], a_1=1)
    policy = affinity()
    assert [policy.select(pool, ask(None)).id for _ in range(4)] == ["r0", "r1", "r0", "r1"]


def test_what_an_engine_reports_running_or_waiting_counts_as_active():
    pool = replicas(0, 0, 0)
    reported(pool[2], running_={"a@1"})
    assert affinity().select(pool, ask("a@1")).id == "r2"
    reported(pool[2], waiting={"a@1"})
    assert affinity().select(pool, ask("a@1")).id == "r2"
    reported(pool[0], running_={"x@1"})  # another router's adapter takes r0's slot
    assert affinity().preferred(pool, "b@1") == [pool[1]]


@pytest.mark.parametrize(("scraped_ago", "reported_ago"), [(10.0, 0.5), (0.5, 10.0)])
def test_an_old_scrape_or_an_idle_engines_last_step_is_not_taken_as_running(
        scraped_ago, reported_ago):
    pool = replicas(0, 0)
    reported(pool[1], running_={"a@1"}, scraped_ago=scraped_ago, reported_ago=reported_ago)
    assert affinity().preferred(pool, "a@1") == pool


def test_the_engines_own_slot_count_wins_over_the_configured_one():
    pool = replicas(0, 0)
    running(pool[0], a_1=1)
    running(pool[1], b_1=1)
    reported(pool[1], running_={"b@1"}, slots=2)
    assert affinity(slots=1).select(pool, ask("c@1")).id == "r1"


def test_prompts_alike_stay_together_among_the_replicas_the_adapter_prefers():
    pool = replicas(0, 0, 0, 0)
    running(pool[1], a_1=1)
    running(pool[3], a_1=1)
    policy = AdapterAffinity(PrefixAffinity(), max_loras=1)
    first = policy.select(pool, ask("a@1", "You are a support agent. " * 4))
    assert first.id in ("r1", "r3")
    again = {policy.select(pool, ask("a@1", "You are a support agent. " * 4)).id
             for _ in range(3)}
    assert again == {first.id}


def test_one_candidate_or_none():
    pool = replicas(0)
    assert affinity().select(pool, ask("a@1")) is pool[0]
    assert affinity().select([], ask("a@1")) is None


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="max_loras"):
        AdapterAffinity(RoundRobin(), max_loras=0)
    with pytest.raises(ValueError, match="load_factor"):
        AdapterAffinity(RoundRobin(), max_loras=1, load_factor=0.5)
