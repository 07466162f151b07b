"""`kv-aware` across a router's data-plane workers, and its peers seen from every worker.

**Prompts placed.** `kv-aware` counts each prompt it placed as held where it went until
that engine reports its blocks (`dpserve.router.kv.forecast`): a tenant's second
request, arriving while the first still prefills, goes to the same replica. With
`--workers N` the kernel hands each connection to any worker, so the second request
is as likely to reach another one. A follower therefore sends the prompts it placed to
the leader at the end of the loop turn that placed them (`prompts`); the leader
forecasts them too, passes them to every other follower and, with peers, to the
peers. The prompts peers report reach the leader and go to every follower the same
way, so every worker forecasts what any worker of any router placed.

**Peers.** Only the leader talks to peers: one sender, one key, one socket, and what it
says is the whole router's (its in-flight counts are every worker's, its recent work
the workers' shared table). Followers route by what the peers said through the
leader's table: each replica's row carries its `peer_in_flight` (`wire.replica_row`),
and the table's `peers` section the peers' recent work (as of the last report heard,
decayed on from there: it changes only when a report arrives, so the table is not sent
again for the clock's sake) and the replicas outside this router's share
(`PeerState.bias`). A follower's `kv-aware` spreads by these as the leader's does.

The peer key stays in the leader: followers get the configuration without the peer
settings (`follower_config`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

from dpserve.config import RouterConfig
from dpserve.router.peers.state import forecast_prompts, replica_key
from dpserve.router.routing.policies import kv_aware_of
from dpserve.router.routing.policies.kv_aware import KVAware, SentPrompt
from dpserve.router.workers.wire import Message


def follower_config(config: RouterConfig) -> RouterConfig:
    """The configuration a follower runs with: the leader's, without its peers (the
    leader alone talks to them, and alone holds their key)."""
    return dataclasses.replace(config, peers=None, peer_bind=None, peer_key=None,
                               peer_key_file=None)


def prompts_message(prompts: Sequence[SentPrompt]) -> Message:
    return {"op": "prompts", "prompts": [[url, size, list(keys)] for url, size, keys in prompts]}


def prompts_from(message: Message) -> list[SentPrompt]:
    return [(url, int(size), tuple(keys)) for url, size, keys in message["prompts"]]


class _Outbox:
    """Prompts placed in this loop turn, sent together at its end."""

    def __init__(self, send: Callable[[list[SentPrompt]], None]) -> None:
        self._send = send
        self._prompts: list[SentPrompt] = []

    def add(self, prompts: Sequence[SentPrompt]) -> None:
        if not self._prompts:
            asyncio.get_running_loop().call_soon(self._flush)
        self._prompts.extend(prompts)

    def _flush(self) -> None:
        prompts, self._prompts = self._prompts, []
        if prompts:
            self._send(prompts)


class LeaderShare:
    """The leader's part: forecasts and passes on every worker's and peer's prompts,
    and puts the peers' view in each table. `broadcast(message, source)` sends to every
    follower but `source` (None: to all)."""

    def __init__(self, router: Any, broadcast: Callable[[Message, object | None], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._kv = kv_aware_of(router.policy)
        self._pool = router.pool
        self._link = router.peers
        self._clock = clock
        self._broadcast = broadcast
        self._outbox = _Outbox(lambda p: broadcast(prompts_message(p), None))
        if self._kv is not None and self._kv.forecast is not None:
            self._kv.on_sent = lambda prompt: self._outbox.add([prompt])
            if self._link is not None:
                self._link.state.on_prompts = self._outbox.add

    def absorb(self, message: Message, source: object) -> None:
        """Prompts a follower placed: forecast here, passed to the other followers and
        kept for the peers."""
        kv = self._kv
        if kv is None or kv.forecast is None:
            return
        prompts = prompts_from(message)
        added, _ = forecast_prompts(kv.index, kv.forecast, self._pool, prompts, self._clock())
        kv.stats.relayed_prompts += len(added)
        kv.keep_for_peers(prompts)
        self._broadcast(message, source)

    def table_section(self) -> Message | None:
        """What the peers said, for the followers' `kv-aware` (None without peers)."""
        if self._link is None or self._kv is None:
            return None
        state = self._link.state
        at, work = state.work_as_of()
        bias: dict[str, float] = {}
        for replica in self._pool:
            key = replica_key(replica.url)
            if value := state.bias(key):
                bias[key] = value
        return {"at": at, "work": work, "bias": bias}


class TablePeers:
    """A follower's view of the peers, as the leader's table last gave it (the
    `PeerWork` a follower's `kv-aware` spreads by)."""

    def __init__(self, half_life_s: float) -> None:
        self._rate = math.log(2) / half_life_s
        self._at = 0.0
        self._work: dict[str, float] = {}
        self._bias: dict[str, float] = {}

    def update(self, section: Message) -> None:
        self._at = section["at"]
        self._work = section["work"]
        self._bias = section["bias"]

    def work(self, url: str, now: float) -> float:
        value = self._work.get(replica_key(url))
        if not value:
            return 0.0
        return float(value) * math.exp(-self._rate * max(0.0, now - self._at))

    def bias(self, url: str) -> float:
        return float(self._bias.get(replica_key(url), 0.0))


class FollowerShare:
    """A follower's part: tells the leader what it placed, forecasts what others placed,
    and spreads by the peers' work as the table gives it."""

    def __init__(self, router: Any, send: Callable[[Message], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._kv: KVAware | None = kv_aware_of(router.policy)
        self._pool = router.pool
        self._clock = clock
        self._peers: TablePeers | None = None
        outbox = _Outbox(lambda p: send(prompts_message(p)))
        if self._kv is not None and self._kv.forecast is not None:
            self._kv.on_sent = lambda prompt: outbox.add([prompt])
            self._peers = TablePeers(self._kv.fallback.half_life_s)

    def absorb(self, message: Message) -> None:
        """Prompts another worker or a peer placed."""
        kv = self._kv
        if kv is not None and kv.forecast is not None:
            added, _ = forecast_prompts(kv.index, kv.forecast, self._pool,
                                        prompts_from(message), self._clock())
            kv.stats.relayed_prompts += len(added)

    def apply(self, section: Message | None) -> None:
        """The table's `peers` section (None: the router has no peers)."""
        if self._kv is None or self._peers is None:
            return
        if section is None:
            self._kv.fallback.peers = None
        else:
            self._peers.update(section)
            self._kv.fallback.peers = self._peers
