"""kv-aware's forecast: a prompt sent counts as cached where it went until its engine
reports it, so a second request with its prefix follows it, and never longer than the
events allow. Also: requests without a prompt are no routing decision."""

from __future__ import annotations

from dpserve.router.fleet.engine_metrics import EngineLoad
from dpserve.router.fleet.pool import Replica, ReplicaPool
from dpserve.router.kv import index as index_module
from dpserve.router.kv.events import Cleared, Removed, Stored
from dpserve.router.kv.forecast import Forecast
from dpserve.router.kv.index import KVIndex
from dpserve.router.routing.policies import PrefixAffinity, RequestInfo
from dpserve.router.routing.policies.engine_load import engine_queue
from dpserve.router.routing.policies.kv_aware import KVAware
from tests.router.routing.policies.fakes import replicas

BS = 4
TENANT = tuple(range(1000, 1032))  # a shared system prompt: 8 blocks of 4


def asks(question: int) -> RequestInfo:
    """A tenant's question: its system prompt, then 8 tokens of its own."""
    return RequestInfo(route="/v1/completions", tokens=TENANT + (question,) * 8,
                       prefix=f"q{question}")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def fleet_with_events(n: int) -> tuple[KVIndex, list[Replica]]:
    """`n` replicas, each having published an (empty) batch: known to the index."""
    index = KVIndex()
    fleet = replicas(*([0] * n))
    for r in fleet:
        index.apply(r.id, 0, [Stored(block_hashes=(), parent=None, token_ids=(),
                                     block_size=BS, lora_name=None, lora_id=None)])
    return index, fleet


def kv_aware(index: KVIndex, clock: Clock, *, forecast: bool = True) -> KVAware:
    return KVAware(index, fallback=PrefixAffinity(clock=clock), clock=clock,
                   forecast=index.forecast(Forecast(ttl_s=10.0)) if forecast else None)


def store(index: KVIndex, rid: str, seq: int, tokens: tuple[int, ...]) -> None:
    blocks = len(tokens) // BS
    index.apply(rid, seq, [Stored(block_hashes=tuple(range(seq * 100, seq * 100 + blocks)),
                                  parent=None, token_ids=tokens[:blocks * BS], block_size=BS,
                                  lora_name=None, lora_id=None)])


def test_a_second_request_follows_a_prompt_whose_blocks_are_not_reported_yet():
    index, fleet = fleet_with_events(4)
    clock = Clock()
    p = kv_aware(index, clock)
    first = p.select(fleet, asks(1))
    assert first is not None
    first.in_flight += 1  # the dispatcher's lease
    # Its engine is still prefilling: no event. The tenant's next question goes there.
    assert p.select(fleet, asks(2)) is first
    # What the router expects the engines to find is their own word, not the forecast.
    assert p.stats.cached_tokens == 0


def test_without_a_forecast_the_second_request_is_spread_elsewhere():
    """The case the forecast exists for: the same two requests, events alone."""
    index, fleet = fleet_with_events(4)
    clock = Clock()
    p = kv_aware(index, clock, forecast=False)
    first = p.select(fleet, asks(1))
    assert first is not None
    first.in_flight += 1
    assert p.select(fleet, asks(2)) is not first


def test_once_the_engine_reports_the_blocks_an_eviction_is_believed():
    """A forecast block leaves the forecast when stored: evicted later, it no longer
    draws requests (it would send them to a replica that recomputes the prefix)."""
    index, fleet = fleet_with_events(4)
    clock = Clock()
    p = kv_aware(index, clock)
    first = p.select(fleet, asks(1))
    assert first is not None
    store(index, first.id, 1, TENANT + (1,) * 8)
    assert p.forecast is not None and not p.forecast.holds(first.id)
    index.apply(first.id, 2, [Removed(block_hashes=tuple(range(100, 110)))])
    held, expected = index.expected_tokens(TENANT, None, p.forecast, clock.now)
    assert held[first.id] == 0 and expected[first.id] == 0


def test_a_forecast_runs_out():
    index, fleet = fleet_with_events(4)
    clock = Clock()
    p = kv_aware(index, clock)
    first = p.select(fleet, asks(1))
    assert first is not None
    clock.now += 10.5  # the request failed before its prefill: nothing was stored
    _, expected = index.expected_tokens(TENANT, None, p.forecast, clock.now)
    assert expected[first.id] == 0


def test_a_cache_reset_clears_the_forecast_too():
    index, fleet = fleet_with_events(2)
    clock = Clock()
    p = kv_aware(index, clock)
    first = p.select(fleet, asks(1))
    assert first is not None
    index.apply(first.id, 1, [Cleared()])
    _, expected = index.expected_tokens(TENANT, None, p.forecast, clock.now)
    assert expected[first.id] == 0


def test_only_the_blocks_not_held_yet_are_forecast():
    """Blocks the replica holds already are the events' to speak for (and to evict)."""
    index, fleet = fleet_with_events(2)
    store(index, "r0", 1, TENANT)
    clock = Clock()
    p = kv_aware(index, clock)
    assert p.select(fleet, asks(1)).id == "r0"
    assert p.forecast is not None
    assert len(p.forecast.holds("r0") or {}) == 2  # the question's 8 tokens: 2 blocks


def test_a_request_without_a_prompt_is_neither_counted_nor_charged():
    index, fleet = fleet_with_events(2)
    clock = Clock()
    p = kv_aware(index, clock)
    for _ in range(5):
        assert p.select(fleet, RequestInfo(route="/v1/models")) is not None
    assert p.stats.fallbacks == {"no_tokens": 0, "no_events": 0} and p.stats.on_events == 0
    assert all(p.fallback.work(r) == 0 for r in fleet)


def test_the_queue_counts_what_peer_routers_sent_since_the_scrape():
    replica = Replica(id="r0", url="http://r0", in_flight=1, peer_in_flight=2)
    ReplicaPool([replica]).record_engine_load(
        replica, EngineLoad(num_requests_running=3, num_requests_waiting=0), 100.0)
    replica.peer_in_flight = 5  # a peer sent three more since
    replica.in_flight = 2  # and this router one
    assert engine_queue(replica, 100.5, 10.0) == 3 + 3 + 1


def test_each_block_of_a_prompt_is_hashed_once_per_request(monkeypatch):
    """Matching hashes as deep as a replica holds the prompt; the forecast of where it
    went reuses those keys and hashes only the rest (not the whole prompt again)."""
    index, fleet = fleet_with_events(4)
    clock = Clock()
    p = kv_aware(index, clock)
    store(index, fleet[0].id, 1, TENANT)  # fleet[0] holds the 8 blocks of the tenant's
    hashed: list[tuple[int, ...]] = []
    real = index_module.chain_key

    def counting(parent: int, tokens: tuple[int, ...]) -> int:
        hashed.append(tokens)
        return real(parent, tokens)

    monkeypatch.setattr(index_module, "chain_key", counting)
    assert p.select(fleet, asks(1)) is fleet[0]
    assert len(hashed) == len(asks(1).tokens) // BS  # 10 full blocks, each once
    assert p.forecast is not None and len(p.forecast.holds(fleet[0].id)) == 2
