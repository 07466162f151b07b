"""A router's link to its peers: what it tells them, and what it hears, composed.

Every `PUBLISH_EVERY_S` the link looks at what it would say (its requests in flight per
replica, and under kv-aware the prompts placed since) and sends a report if that
changed, or if `HEARTBEAT_S` passed since the last one (so peers know it is alive and
its decayed work stays current). A request's placement reaches the peers within ~10 ms
plus the network: well inside a prefill (100 ms to seconds), which is the window in
which a second router would otherwise not know of it (benchmarks/routing/README.md,
kv_ties).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time

from dpserve.config import RouterConfig
from dpserve.router.fleet.pool import ReplicaPool
from dpserve.router.kv.index import KEY_FINGERPRINT
from dpserve.router.peers.channel import ChannelStats, PeerChannel
from dpserve.router.peers.state import PeerState, replica_key
from dpserve.router.peers.wire import MAX_KEYS, MAX_PENDING, PeerReport
from dpserve.router.routing.policies.kv_aware import KVAware, SentPrompt

log = logging.getLogger("dpserve.router")

PUBLISH_EVERY_S = 0.01
"""How often the link looks for something to tell: 100 wake-ups a second, each a few
microseconds when nothing changed."""
HEARTBEAT_S = 1.0
"""Longest time between two reports (`dpserve.router.peers.state.PEER_SILENT_S` is three)."""
MIN_WORK = 0.01
"""Work below this is not reported (it has decayed to nothing)."""
MAX_REPORT_KEYS = 65_536
"""Chain keys in one report (~600 KiB of msgpack, under the wire's 1 MiB): 32 prompts of
32k tokens in 16-token blocks. Past it, the oldest prompts are not told (a peer then
misses a forecast, nothing else)."""


def bounded(pending: list[SentPrompt]) -> tuple[SentPrompt, ...]:
    """The newest of `pending` that fit one report: at most `MAX_PENDING` prompts,
    `MAX_KEYS` keys each (a prompt's leading blocks: the chain is matched from its
    start) and `MAX_REPORT_KEYS` in all."""
    kept: list[SentPrompt] = []
    room = MAX_REPORT_KEYS
    for url, size, keys in reversed(pending[-MAX_PENDING:]):
        keys = keys[:min(MAX_KEYS, room)]
        if not keys:
            break
        kept.append((url, size, keys))
        room -= len(keys)
    kept.reverse()
    return tuple(kept)


class PeerLink:
    """Owns the channel, the peers' state and the publishing task."""

    def __init__(self, pool: ReplicaPool, config: RouterConfig,
                 kv_aware: KVAware | None) -> None:
        assert config.peers and config.peer_key is not None  # checked by the config
        self._pool = pool
        self._kv = kv_aware
        self.sender = os.urandom(16)
        self.state = PeerState(pool, sender=self.sender, index=kv_aware.index if kv_aware else None,
                               forecast=kv_aware.forecast if kv_aware else None,
                               half_life_s=(kv_aware.fallback.half_life_s if kv_aware
                                            else 2.0))
        self.channel = PeerChannel(bind=config.peer_bind, peers=config.peers,
                                   key=config.peer_key.encode(), sender=self.sender,
                                   on_report=self.state.receive)
        if kv_aware is not None:
            kv_aware.fallback.peers = self.state
            kv_aware.take_sent()  # start keeping what it places
        self._peer_names = list(config.peers)
        self._bind = config.peer_bind
        self._seq = 0
        self._task: asyncio.Task[None] | None = None
        self._said: dict[str, int] | None = None
        self._said_at = 0.0

    @property
    def channel_stats(self) -> ChannelStats:
        return self.channel.stats

    async def start(self) -> None:
        await self.channel.start()
        self._task = asyncio.create_task(self._run(), name="dpserve-peers")
        log.info("peers: %s; publishing on %s", ", ".join(self._peer_names),
                 self._bind or "nothing (listening only)")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(PUBLISH_EVERY_S)
            try:
                self.tick(time.monotonic())
            except Exception:  # never let one bad tick end the peering
                log.exception("peers: could not publish a report")

    def tick(self, now: float) -> None:
        """Publish a report if there is something new to say or a heartbeat is due."""
        in_flight = {replica_key(r.url): r.in_flight for r in self._pool if r.in_flight}
        pending = self._kv.take_sent() if self._kv is not None else []
        if in_flight == self._said and not pending and now - self._said_at < HEARTBEAT_S:
            return
        self.state.expire()
        work: dict[str, float] = {}
        if self._kv is not None:
            for replica in self._pool:
                value = self._kv.fallback.work(replica)
                if value >= MIN_WORK:
                    work[replica_key(replica.url)] = value
        report = PeerReport(sender=self.sender, seq=self._seq, in_flight=in_flight,
                            work=work, pending=bounded(pending),
                            fingerprint=KEY_FINGERPRINT)
        self._seq += 1
        self.channel.publish(report)
        self._said, self._said_at = in_flight, now

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self.channel.aclose()
