"""The KV-aware policy: exact cached prefix against the engines' shared load, and a
visible fallback when the events cannot decide."""

from __future__ import annotations

from collections import Counter

import pytest

from dpserve.router.fleet.engine_metrics import EngineLoad
from dpserve.router.fleet.pool import Replica, ReplicaPool
from dpserve.router.kv.events import Cleared, Stored
from dpserve.router.kv.index import KVIndex
from dpserve.router.routing.policies import PrefixAffinity, RequestInfo, make_policy
from dpserve.router.routing.policies.engine_load import engine_queue
from dpserve.router.routing.policies.kv_aware import ENGINE_REPORT_MAX_AGE_S, KVAware
from tests.router.routing.policies.fakes import replicas

BS = 4
PROMPT = tuple(range(1000, 1032))  # 8 blocks of 4


def request(tokens: tuple[int, ...] | None = PROMPT, adapter: str | None = None,
            prefix: str | None = "same") -> RequestInfo:
    return RequestInfo(route="/v1/completions", tokens=tokens, adapter=adapter, prefix=prefix)


def stored(index: KVIndex, rid: str, blocks: int, *, seq: int = 0, lora: str | None = None,
           tokens: tuple[int, ...] = PROMPT) -> None:
    """`rid` stored the first `blocks` blocks of `tokens`, in one event."""
    index.apply(rid, seq, [Stored(block_hashes=tuple(range(seq * 100 + 1,
                                                           seq * 100 + blocks + 1)),
                                  parent=None, token_ids=tokens[:blocks * BS], block_size=BS,
                                  lora_name=lora, lora_id=None)])


def scraped(replica: Replica, running: int, waiting: int = 0, at: float = 100.0) -> None:
    ReplicaPool([replica]).record_engine_load(
        replica, EngineLoad(num_requests_running=running, num_requests_waiting=waiting), at)


def policy(index: KVIndex, **kw: float) -> KVAware:
    return KVAware(index, fallback=PrefixAffinity(), clock=lambda: 100.0, **kw)


def test_the_replica_holding_the_longest_prefix_gets_the_request():
    index = KVIndex()
    fleet = replicas(0, 0, 0)
    stored(index, "r0", 2)
    stored(index, "r1", 7)
    stored(index, "r2", 0)
    p = policy(index)
    assert p.select(fleet, request()).id == "r1"
    assert p.stats.on_events == 1 and p.stats.last_cached_tokens == 7 * BS
    assert p.stats.cached_tokens == 28 and p.stats.prompt_tokens == 32
    assert p.stats.cached_histogram == [0, 0, 1, 0, 0, 0, 0, 0]  # 28: in (16, 64]


def test_a_cached_prefix_is_not_worth_any_queue():
    """At load weight 0.05 a whole cached prompt is worth at most nineteen queued
    requests."""
    index = KVIndex()
    cached, empty = replicas(0, 0)
    stored(index, "r0", 8)
    stored(index, "r1", 0)
    scraped(empty, running=0)
    scraped(cached, running=19)  # 19 x 0.05 = 0.95 < the whole prefill (1.0)
    assert policy(index).select([cached, empty], request()).id == "r0"
    scraped(cached, running=21)  # 21 x 0.05 = 1.05
    assert policy(index).select([cached, empty], request()).id == "r1"


def test_the_load_is_the_engines_own_count_which_every_router_sees():
    """A replica another router filled (its engine reports 6 running) loses the
    request although this router sent it nothing."""
    index = KVIndex()
    busy, idle = replicas(0, 0)
    stored(index, "r0", 4)
    stored(index, "r1", 4)
    scraped(busy, running=6)
    scraped(idle, running=0)
    assert engine_queue(busy, 100.0, ENGINE_REPORT_MAX_AGE_S) == 6.0
    assert engine_queue(idle, 100.0, ENGINE_REPORT_MAX_AGE_S) == 0.0
    assert policy(index).select([busy, idle], request()).id == "r1"


def test_a_stale_engine_report_counts_the_routers_own_in_flight():
    (r,) = replicas(2)
    scraped(r, running=9, at=50.0)
    assert engine_queue(r, 100.0, ENGINE_REPORT_MAX_AGE_S) == 2.0  # 50 s old: not believed


def test_a_block_cached_under_another_adapter_is_no_hit():
    index = KVIndex()
    fleet = replicas(0, 0)
    stored(index, "r0", 8, lora="a@1")
    stored(index, "r1", 3)
    assert policy(index).select(fleet, request(adapter=None)).id == "r1"
    assert policy(index).select(fleet, request(adapter="a@1")).id == "r0"


def test_new_prefixes_spread_evenly_when_nothing_is_cached():
    index = KVIndex()
    fleet = replicas(0, 0, 0, 0)
    for r in fleet:
        stored(index, r.id, 0)
    p = policy(index)
    chosen = Counter(p.select(fleet, request(tokens=(i,) * 32)).id for i in range(40))
    assert chosen == dict.fromkeys(["r0", "r1", "r2", "r3"], 10)


@pytest.mark.parametrize("tokens", [None, ()])
def test_without_token_ids_the_fallback_places_the_request_and_says_why(tokens):
    index = KVIndex()
    fleet = replicas(0, 0)
    stored(index, "r1", 8)
    p = policy(index)
    picks = {p.select(fleet, request(tokens=tokens, prefix="tenant-a")).id for _ in range(5)}
    assert len(picks) == 1  # prefix affinity: one home for the prefix
    assert p.stats.fallbacks == {"no_tokens": 5, "no_events": 0} and p.stats.on_events == 0


def test_with_no_replica_publishing_events_the_fallback_places_the_request():
    p = policy(KVIndex())
    assert p.select(replicas(0, 0), request()) is not None
    assert p.stats.fallbacks == {"no_tokens": 0, "no_events": 1}


def test_a_replica_that_missed_events_is_not_trusted_and_its_cache_not_counted():
    index = KVIndex()
    fleet = replicas(0, 0)
    stored(index, "r0", 8)
    index.apply("r0", 5, [])  # batches 1..4 missed: stale until replayed or cleared
    stored(index, "r1", 1)
    assert policy(index).select(fleet, request()).id == "r1"
    index.drop("r1")
    p = policy(index)
    assert p.select(fleet, request()) is not None  # r0 alone, stale: nothing is known
    assert p.stats.fallbacks == {"no_tokens": 0, "no_events": 1}


def test_a_cache_reset_is_no_longer_routed_to():
    index = KVIndex()
    fleet = replicas(0, 0)
    stored(index, "r0", 8)
    stored(index, "r1", 2)
    index.apply("r0", 1, [Cleared()])
    assert policy(index).select(fleet, request()).id == "r1"


def test_a_replica_at_the_load_cap_is_passed_over_whatever_it_holds():
    index = KVIndex()
    fleet = replicas(40, 0, 0, 0, 0)  # r0 far past 3 x the average in flight (8)
    stored(index, "r0", 8)
    assert policy(index, load_weight=0.0).select(fleet, request()).id != "r0"


def test_make_policy_builds_it_with_a_prefix_affinity_fallback():
    p = make_policy("kv-aware", kv_index=KVIndex())
    assert isinstance(p, KVAware) and isinstance(p.fallback, PrefixAffinity)
    assert {"tokens", "engine_load", "prefix"} <= p.needs


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="load_weight"):
        KVAware(KVIndex(), fallback=PrefixAffinity(), load_weight=-1)
    with pytest.raises(ValueError, match="load_factor"):
        KVAware(KVIndex(), fallback=PrefixAffinity(), load_factor=0.5)
