"""Which replicas' KV events the router follows: each ready replica's source found
(its `/kv_event_sources`, or the operator's override) and subscribed to, and its
index entries dropped the moment what it caches can no longer be known.

A replica's entries go when it leaves the pool or turns `starting` (a restart: its
engine comes back empty), `reloading` (a hot-load resets its prefix cache) or `down`;
its subscription starts again when it is next ready, from the first batch it then
publishes. A draining replica keeps its subscription: its cache is still there, and
it may come back. What the router knows of each replica's source is in `status`, for
the admin API and `/metrics`: a replica that publishes nothing is routed by the
fallback, and says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable
from typing import Protocol

import httpx

from dpserve.router.fleet.pool import Replica, ReplicaPool, ReplicaState
from dpserve.router.kv.sources import (
    MAX_SOURCES_BYTES,
    EventSource,
    SourceError,
    parse_sources,
)

log = logging.getLogger("dpserve.router")

SOURCES_TIMEOUT_S = 5.0
"""Time a replica has to answer `/kv_event_sources`."""
_FORGET = frozenset({ReplicaState.STARTING, ReplicaState.RELOADING, ReplicaState.DOWN})


class Subscriptions(Protocol):
    """The subscribers that feed the index (`dpserve.router.kv.subscriber`)."""

    def start(self, replica_id: str, source: EventSource) -> None:
        """Follow `replica_id`'s events from `source`, afresh."""

    def stop(self, replica_id: str) -> None:
        """Stop following it and drop what the index holds of it."""

    async def aclose(self) -> None: ...


class KVEventFeeds:
    """Keeps one subscription per ready replica that publishes KV events."""

    def __init__(self, pool: ReplicaPool, subscriptions: Subscriptions,
                 control: httpx.AsyncClient, *,
                 override: Callable[[str], EventSource] | None = None) -> None:
        self._pool = pool
        self._subs = subscriptions
        self._control = control
        self._override = override
        self._following: dict[str, EventSource] = {}
        self._finding: dict[str, asyncio.Task[None]] = {}
        self.status: dict[str, str] = {}
        """Per replica id: `following`, `not published` (events off), or why not, in
        one line."""
        self._started = False
        pool.on_state_change(self._changed)
        pool.on_membership(lambda r: None, self._left)

    def start(self) -> None:
        """Find and follow every replica that is ready now; later ones as they turn so."""
        self._started = True
        for replica in self._pool.ready():
            self._find(replica)

    @property
    def following(self) -> list[str]:
        return sorted(self._following)

    def _changed(self, replica: Replica, old: ReplicaState, new: ReplicaState) -> None:
        if new in _FORGET:
            self._forget(replica.id, f"replica {new.value}")
        elif new is ReplicaState.READY and self._started:
            self._find(replica)

    def _left(self, replica: Replica) -> None:
        self._forget(replica.id, None)

    def _forget(self, replica_id: str, why: str | None) -> None:
        finding = self._finding.pop(replica_id, None)
        if finding is not None:
            finding.cancel()
        if self._following.pop(replica_id, None) is not None:
            self._subs.stop(replica_id)
        if why is None:
            self.status.pop(replica_id, None)
        else:
            self.status[replica_id] = why

    def _find(self, replica: Replica) -> None:
        if replica.id in self._following or replica.id in self._finding:
            return
        task = asyncio.get_running_loop().create_task(self._follow(replica),
                                                      name=f"dpserve-kv-find-{replica.id}")
        self._finding[replica.id] = task
        task.add_done_callback(functools.partial(self._found, replica.id))

    def _found(self, replica_id: str, task: asyncio.Task[None]) -> None:
        if self._finding.get(replica_id) is task:
            del self._finding[replica_id]

    async def _follow(self, replica: Replica) -> None:
        try:
            source = (self._override(replica.url) if self._override is not None
                      else await self._ask(replica))
        except SourceError as exc:
            self._report(replica.id, f"not followed: {exc}")
            return
        if source is None:
            self._report(replica.id, "not published")
            return
        if replica.state is not ReplicaState.READY and replica.state is not (
                ReplicaState.DRAINING):
            return  # it left while we asked
        self._following[replica.id] = source
        self._subs.start(replica.id, source)
        self.status[replica.id] = "following"
        log.info("replica %s: following its KV events at %s", replica.id, source.endpoint)

    def _report(self, replica_id: str, why: str) -> None:
        if self.status.get(replica_id) != why:
            log.warning("replica %s: KV events %s; it is routed by the fallback policy",
                        replica_id, why)
        self.status[replica_id] = why

    async def _ask(self, replica: Replica) -> EventSource | None:
        """The replica's own answer; SourceError if it gives none usable."""
        url = replica.url.rstrip("/") + "/kv_event_sources"
        try:
            async with self._control.stream("GET", url, timeout=SOURCES_TIMEOUT_S) as r:
                if r.status_code == 404:
                    raise SourceError("not offered (no /kv_event_sources: vLLM before 0.32?)")
                if r.status_code != 200:
                    raise SourceError(f"/kv_event_sources answered {r.status_code}")
                body = bytearray()
                async for piece in r.aiter_bytes():
                    body += piece
                    if len(body) > MAX_SOURCES_BYTES:
                        raise SourceError(f"/kv_event_sources answer is over "
                                          f"{MAX_SOURCES_BYTES} bytes")
        except httpx.HTTPError as exc:
            raise SourceError(f"/kv_event_sources unreachable ({type(exc).__name__})") from None
        return parse_sources(bytes(body), replica.url)

    async def aclose(self) -> None:
        for task in list(self._finding.values()):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._finding.clear()
        self._following.clear()
        await self._subs.aclose()
