"""What a router does with its peers' reports: their in-flight counts on its replicas,
their work in its tie-break, their prompts in its forecast; and what it ignores."""

from __future__ import annotations

from dpserve.router.fleet.pool import Replica, ReplicaPool
from dpserve.router.kv.events import Stored
from dpserve.router.kv.index import KEY_FINGERPRINT, KVIndex, prompt_keys
from dpserve.router.peers.link import MAX_REPORT_KEYS, bounded
from dpserve.router.peers.state import SHARE_BIAS, PeerState
from dpserve.router.peers.wire import MAX_KEYS, MAX_PENDING, PeerReport
from dpserve.router.routing.policies import PrefixAffinity, RequestInfo
from dpserve.router.routing.policies.kv_aware import KVAware

A, B = b"a" * 16, b"b" * 16
TENANT = tuple(range(1000, 1032))


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def report(sender: bytes, seq: int, in_flight: dict[str, int] | None = None,
           work: dict[str, float] | None = None,
           pending: tuple[tuple[str, int, tuple[int, ...]], ...] = (),
           fingerprint: int = KEY_FINGERPRINT) -> PeerReport:
    return PeerReport(sender=sender, seq=seq, in_flight=in_flight or {}, work=work or {},
                      pending=pending, fingerprint=fingerprint)


def pool(n: int) -> ReplicaPool:
    return ReplicaPool([Replica(id=f"r{i}", url=f"http://10.0.0.{i}:8000") for i in range(n)])


def test_the_peers_in_flight_add_up_on_each_replica_and_leave_with_a_silent_peer():
    replicas, clock = pool(2), Clock()
    state = PeerState(replicas, clock=clock, silent_s=3.0)
    state.receive(report(A, 0, {"http://10.0.0.0:8000": 2, "http://10.0.0.1:8000/": 1}))
    state.receive(report(B, 0, {"http://10.0.0.0:8000": 3}))
    assert [r.peer_in_flight for r in replicas] == [5, 1]
    state.receive(report(A, 1, {"http://10.0.0.0:8000": 1}))  # absolute, not a delta
    assert [r.peer_in_flight for r in replicas] == [4, 0]
    clock.now += 2.0
    state.receive(report(B, 1, {"http://10.0.0.0:8000": 3}))
    clock.now += 2.0  # A silent for 4 s: a router that died holds nothing
    state.expire()
    assert [r.peer_in_flight for r in replicas] == [3, 0]
    assert state.live() == 1 and state.stats.forgotten == 1


def test_a_report_older_than_one_applied_is_ignored():
    replicas = pool(1)
    state = PeerState(replicas)
    state.receive(report(A, 5, {"http://10.0.0.0:8000": 2}))
    state.receive(report(A, 4, {"http://10.0.0.0:8000": 9}))
    assert replicas.get("r0").peer_in_flight == 2  # type: ignore[union-attr]
    assert state.stats.out_of_order == 1


def test_the_peers_work_decays_from_when_it_was_heard():
    clock = Clock()
    state = PeerState(pool(1), clock=clock, half_life_s=2.0)
    state.receive(report(A, 0, work={"http://10.0.0.0:8000": 4.0}))
    assert state.work("http://10.0.0.0:8000/", clock.now) == 4.0
    assert abs(state.work("http://10.0.0.0:8000", clock.now + 2.0) - 2.0) < 1e-9
    assert state.work("http://10.0.0.9:8000", clock.now) == 0.0


def known(index: KVIndex, replicas: ReplicaPool) -> None:
    for r in replicas:
        index.apply(r.id, 0, [Stored(block_hashes=(), parent=None, token_ids=(),
                                     block_size=4, lora_name=None, lora_id=None)])


def test_a_prompt_a_peer_sent_draws_this_routers_request_with_its_prefix():
    replicas, clock = pool(4), Clock()
    index = KVIndex()
    known(index, replicas)
    policy = KVAware(index, fallback=PrefixAffinity(clock=clock), forecast=index.forecast(),
                     clock=clock)
    state = PeerState(replicas, index=index, forecast=policy.forecast, clock=clock)
    keys = tuple(prompt_keys(TENANT, None, 4))
    state.receive(report(A, 0, {"http://10.0.0.2:8000": 1},
                         pending=(("http://10.0.0.2:8000", 4, keys),)))
    chosen = policy.select(list(replicas), RequestInfo(route="/v1/completions",
                                                       tokens=TENANT + (7,) * 8))
    assert chosen is not None and chosen.id == "r2"
    assert state.stats.prompts == 1


def test_prompts_of_another_build_or_an_unknown_replica_are_not_taken():
    replicas, clock = pool(2), Clock()
    index = KVIndex()
    known(index, replicas)
    forecast = index.forecast()
    state = PeerState(replicas, index=index, forecast=forecast, clock=clock)
    keys = tuple(prompt_keys(TENANT, None, 4))
    state.receive(report(A, 0, pending=(("http://10.0.0.1:8000", 4, keys),),
                         fingerprint=KEY_FINGERPRINT + 1))
    state.receive(report(A, 1, pending=(("http://10.9.9.9:8000", 4, keys),
                                        ("http://10.0.0.1:8000", 16, keys))))
    assert forecast.size() == 0
    assert state.stats.foreign_keys == 1 and state.stats.unknown_replicas == 2


def test_a_report_keeps_the_newest_prompts_within_the_wires_bounds():
    many = [(f"http://r{i}", 16, tuple(range(5000))) for i in range(MAX_PENDING + 10)]
    kept = bounded(many)
    assert kept[-1][0] == many[-1][0]  # the newest first to be kept
    assert all(len(keys) <= MAX_KEYS for _, _, keys in kept)
    assert sum(len(keys) for _, _, keys in kept) <= MAX_REPORT_KEYS
    assert kept[0][2] == tuple(range(len(kept[0][2])))  # a prompt's leading blocks


def test_each_router_prefers_its_own_share_of_the_replicas_while_peers_are_heard():
    """Two routers reading the same ~10 ms old counts would pick the same replica for
    prompts arriving together; each leans to its own share instead, and alone to none."""
    replicas, clock = pool(4), Clock()
    mine = PeerState(replicas, sender=A, clock=clock)
    theirs = PeerState(replicas, sender=B, clock=clock)
    urls = [r.url for r in replicas]
    assert [mine.bias(u) for u in urls] == [0.0] * 4  # no peer heard
    mine.receive(report(B, 0))
    theirs.receive(report(A, 0))
    a = [mine.bias(u) for u in urls]
    b = [theirs.bias(u) for u in urls]
    assert sorted(a) == [0.0, 0.0, SHARE_BIAS, SHARE_BIAS]
    assert [x + y for x, y in zip(a, b, strict=True)] == [SHARE_BIAS] * 4  # disjoint shares
    clock.now += 10.0  # the peer went silent: the whole fleet is this router's again
    assert [mine.bias(u) for u in urls] == [0.0] * 4
