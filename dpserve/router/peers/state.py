"""What this router's peers told it, applied where routing reads it.

- **In flight.** Each report carries its sender's requests in flight per replica,
  absolute. Their sum over live peers becomes the replica's `peer_in_flight`, which
  :func:`~dpserve.router.routing.policies.engine_load.engine_queue` adds to the engine's
  last report as it does this router's own: two routers then see each other's sends
  of the last second, which the engines' scrape (up to 1 s old) does not show. Without
  that, two kv-aware routers put 18-19% of new prompts on a replica already prefilling
  another, one router 6% (benchmarks/routing/README.md, kv_ties).
- **Work.** Each sender's decayed count of recent work per replica, decayed on here from
  when it arrived (`work`): kv-aware breaks ties by its own count plus its peers'.
- **Prompts sent.** The chain keys of each prompt a peer sent, added to this router's
  forecast for that replica (`dpserve.router.kv.forecast`): a tenant's second request
  finds the first one's prefill wherever it went, whichever router placed it. Only
  from peers whose keys mean the same (`KEY_FINGERPRINT`), at the replica's block size.

- **Shares.** Reports are ~10 ms old when read, and two routers reading the same counts
  pick the same least-loaded replica for prompts that arrive close together: on prompts
  sharing nothing (`uniform`, 22 req/s, 8 replicas, virtual time) that made two routers
  with peers heard 15 ms late 1.21x one router's mean TTFT, worse than without peers
  (1.16x). So each router prefers a share of the replicas for new work (`bias`): the
  replicas in URL order, dealt round the live routers in sender order; the others
  carry `SHARE_BIAS` more work. The shared counts still move work across shares when
  one is busier.

A peer not heard for `silent_s` is forgotten: its in-flight counts leave the replicas
(a router that died holds nothing). Reports of one sender arriving out of order are
ignored (`seq`); a restarted router is a new sender. Bounded: `max_peers` senders,
the longest silent forgotten first.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from dpserve.router.fleet.pool import ReplicaPool
from dpserve.router.kv.forecast import Forecast
from dpserve.router.kv.index import KEY_FINGERPRINT, KVIndex
from dpserve.router.peers.wire import PeerReport
from dpserve.router.routing.policies.kv_aware import SentPrompt
from dpserve.router.routing.policies.recent_work import DEFAULT_HALF_LIFE_S

PEER_SILENT_S = 3.0
"""A peer reports at least every second (`dpserve.router.peers.link`); three missed
heartbeats and its counts are dropped."""
SHARE_BIAS = 1.0
"""Work (requests sent lately) added to a replica outside this router's share when
spreading: enough to keep two routers apart when the fleet is evenly loaded, little
against a replica truly busier (benchmarks/routing/README.md, peers)."""
MAX_PEERS = 64
"""Senders remembered: a fleet has a few routers; restarts make new senders, which the
silent rule forgets within seconds."""


def replica_key(url: str) -> str:
    """A replica's URL as routers compare it."""
    return url.rstrip("/")


@dataclass(slots=True)
class _Peer:
    seq: int
    heard_at: float
    in_flight: dict[str, int]
    work: dict[str, float]
    """Replica URL -> the sender's work there, as of `heard_at`."""


@dataclass(slots=True)
class PeerStats:
    """What the peers' reports did, for `/metrics`."""

    reports: int = 0
    """Reports applied."""
    out_of_order: int = 0
    """Reports older than one already applied from the same sender, ignored."""
    foreign_keys: int = 0
    """Reports whose prompts' keys this router cannot read (another build), prompts
    ignored."""
    prompts: int = 0
    """Prompts of peers added to the forecast."""
    unknown_replicas: int = 0
    """Prompts for a replica this router does not have or has no events of yet."""
    forgotten: int = 0
    """Peers dropped after `silent_s` without a report."""


class PeerState:
    """The peers' reports, kept and applied to `pool`'s replicas and to `forecast`."""

    def __init__(self, pool: ReplicaPool, *, sender: bytes = b"", index: KVIndex | None = None,
                 forecast: Forecast | None = None, half_life_s: float = DEFAULT_HALF_LIFE_S,
                 silent_s: float = PEER_SILENT_S, max_peers: int = MAX_PEERS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._pool = pool
        self._index = index
        self._forecast = forecast
        self._rate = math.log(2) / half_life_s
        self._silent_s = silent_s
        self._max_peers = max_peers
        self._clock = clock
        self._peers: dict[bytes, _Peer] = {}
        self._sender = sender
        self._shares: tuple[tuple[bytes, ...], float, frozenset[str]] | None = None
        """(routers, when, this router's share) as last dealt."""
        self.stats = PeerStats()
        self.on_prompts: Callable[[list[SentPrompt]], None] | None = None
        """Told of the peers' prompts added to the forecast (the router's other
        data-plane workers forecast them too: `dpserve.router.workers.kv_share`)."""

    def receive(self, report: PeerReport) -> None:
        """Apply one report (the channel's `on_report`)."""
        now = self._clock()
        peer = self._peers.get(report.sender)
        if peer is not None and report.seq <= peer.seq:
            self.stats.out_of_order += 1
            return
        if peer is None and len(self._peers) >= self._max_peers:
            oldest = min(self._peers, key=lambda s: self._peers[s].heard_at)
            del self._peers[oldest]
        self._peers[report.sender] = _Peer(
            seq=report.seq, heard_at=now,
            in_flight={replica_key(u): n for u, n in report.in_flight.items()},
            work={replica_key(u): w for u, w in report.work.items()})
        self.stats.reports += 1
        self._apply_in_flight()
        if report.pending:
            self._add_prompts(report, now)

    def expire(self) -> None:
        """Forget peers silent for `silent_s` (call it every so often)."""
        now = self._clock()
        gone = [s for s, p in self._peers.items() if now - p.heard_at > self._silent_s]
        for sender in gone:
            del self._peers[sender]
        if gone:
            self.stats.forgotten += len(gone)
            self._apply_in_flight()

    def live(self) -> int:
        """Peers heard within `silent_s`."""
        now = self._clock()
        return sum(1 for p in self._peers.values() if now - p.heard_at <= self._silent_s)

    def work(self, url: str, now: float) -> float:
        """The peers' decayed work sent to the replica at `url`, at `now` (kv-aware's
        tie-break: :class:`~dpserve.router.routing.policies.base.PeerWork`)."""
        key = replica_key(url)
        total = 0.0
        for peer in self._peers.values():
            value = peer.work.get(key)
            if value:
                total += value * math.exp(-self._rate * max(0.0, now - peer.heard_at))
        return total

    def bias(self, url: str) -> float:
        """0 for a replica in this router's share, `SHARE_BIAS` for another's."""
        now = self._clock()
        routers = tuple(sorted([self._sender, *(s for s, p in self._peers.items()
                                                if now - p.heard_at <= self._silent_s)]))
        if len(routers) < 2:
            return 0.0
        shares = self._shares
        if shares is None or shares[0] != routers or now - shares[1] > 1.0:
            # Dealt again when the routers change, and every second (replicas come
            # and go): a sort per decision would cost more than the decision.
            urls = sorted(replica_key(r.url) for r in self._pool)
            me = routers.index(self._sender)
            mine = frozenset(u for i, u in enumerate(urls) if i % len(routers) == me)
            shares = self._shares = (routers, now, mine)
        return 0.0 if replica_key(url) in shares[2] else SHARE_BIAS

    def _apply_in_flight(self) -> None:
        totals: dict[str, int] = {}
        for peer in self._peers.values():
            for url, n in peer.in_flight.items():
                totals[url] = totals.get(url, 0) + n
        for replica in self._pool:
            replica.peer_in_flight = totals.get(replica_key(replica.url), 0)

    def work_as_of(self) -> tuple[float, dict[str, float]]:
        """The peers' work per replica URL as of the last report heard (work decays the
        same for all: at `now` it is each value times exp(-rate (now - at))), so that
        it changes only when a report arrives: (at, {url: work})."""
        if not self._peers:
            return 0.0, {}
        at = max(p.heard_at for p in self._peers.values())
        totals: dict[str, float] = {}
        for peer in self._peers.values():
            decay = math.exp(-self._rate * (at - peer.heard_at))
            for url, value in peer.work.items():
                totals[url] = totals.get(url, 0.0) + value * decay
        return at, totals

    def _add_prompts(self, report: PeerReport, now: float) -> None:
        index, forecast = self._index, self._forecast
        if index is None or forecast is None:
            return
        if report.fingerprint != KEY_FINGERPRINT:
            self.stats.foreign_keys += 1
            return
        added, unknown = forecast_prompts(index, forecast, self._pool, report.pending, now)
        self.stats.prompts += len(added)
        self.stats.unknown_replicas += unknown
        if added and self.on_prompts is not None:
            self.on_prompts(added)


def forecast_prompts(index: KVIndex, forecast: Forecast, pool: ReplicaPool,
                     prompts: Iterable[SentPrompt], now: float
                     ) -> tuple[list[SentPrompt], int]:
    """Add prompts placed elsewhere (by a peer, or by another worker of this router) to
    `forecast`, each for the replica of its URL if `index` has that replica at the same
    block size: (those added, how many were not)."""
    by_url = {replica_key(r.url): r for r in pool}
    added: list[SentPrompt] = []
    unknown = 0
    for url, size, keys in prompts:
        replica = by_url.get(replica_key(url))
        if replica is None or index.block_size(replica.id) != size:
            unknown += 1
            continue
        forecast.add(replica.id, keys, now)
        added.append((url, size, keys))
    return added, unknown
