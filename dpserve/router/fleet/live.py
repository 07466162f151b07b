"""The migratable streams running on each replica, so a drain can move them on cue,
and when each replica last sent one of them a chunk (a replica silent for the idle
timeout while a stream waits for its first token is stalled, not busy).

A stream registers its upstream response for as long as it relays it
(`dpserve.router.forward.stream`). `evict(replica)` interrupts every one on that
replica with `Evicted`: each relay then sees its replica's stream break and moves
it to another replica, exactly as if the replica had died (reason `drained`). A
rolling deploy calls it when a drained replica's requests are still running at
the drain deadline, so that they finish elsewhere instead of being frozen by the
pause and resumed on the new weights. A stream still waiting for its first chunk
(`dpserve.router.forward.stream`) registers too, as one that *restarts*: its client has
nothing yet, so it starts over elsewhere; only the others *migrate* (carry on from
the tokens their client has), and only those can mix two weight versions.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from dpserve.router.upstream.connection import Disconnected, UpstreamResponse


class Evicted(Disconnected):
    """The router took the stream off its replica (drained with a deadline)."""


@dataclass(frozen=True)
class Moving:
    """Streams that can leave a replica, by how they go."""

    migrating: int = 0
    """Carry on elsewhere from the tokens their client has."""
    restarting: int = 0
    """Start over elsewhere: their client has nothing yet."""

    def __add__(self, other: Moving) -> Moving:
        return Moving(self.migrating + other.migrating, self.restarting + other.restarting)

    def __bool__(self) -> bool:
        return bool(self.migrating or self.restarting)

    @property
    def total(self) -> int:
        return self.migrating + self.restarting


NONE_MOVING = Moving()


class Peers(Protocol):
    """The streams other data-plane workers run (`dpserve.router.workers`)."""

    def movable(self, replica_id: str) -> Moving: ...

    def evict(self, replica_id: str) -> Moving: ...


class LiveStreams:
    def __init__(self) -> None:
        self._on: dict[str, dict[UpstreamResponse, tuple[Callable[[], bool], bool]]] = {}
        """Per replica: each stream's `movable` and whether it would restart."""
        self.peers: Peers | None = None
        """Other workers' streams, counted and evicted with this worker's."""
        self._heard: dict[str, float] = {}
        """Per replica with a stream registered here: when a stream last got a chunk
        from it (`time.monotonic`). Only a registered stream waits for its first chunk
        and asks, so nothing else is kept: the map holds no more replicas than `_on`."""

    def heard(self, replica_id: str) -> None:
        """A stream got a chunk from `replica_id`: it is working."""
        if replica_id in self._on:
            self._heard[replica_id] = time.monotonic()

    def last_heard(self, replica_id: str) -> float:
        """When a stream of this worker last got a chunk from `replica_id` (0: never)."""
        return self._heard.get(replica_id, 0.0)

    @contextlib.contextmanager
    def running(self, replica_id: str, resp: UpstreamResponse,
                movable: Callable[[], bool], *, restarts: bool = False) -> Iterator[None]:
        """While relaying `resp` from `replica_id`; `movable()` says whether the stream
        could move now (its prompt ids came, no limit reached); `restarts`: it has sent
        its client nothing, so moving it starts it over."""
        streams = self._on.setdefault(replica_id, {})
        streams[resp] = (movable, restarts)
        try:
            yield
        finally:
            del streams[resp]
            if not streams:
                del self._on[replica_id]
                self._heard.pop(replica_id, None)

    def replicas(self) -> list[str]:
        """The replicas with a stream running here."""
        return list(self._on)

    def _here(self, replica_id: str) -> list[tuple[UpstreamResponse, bool]]:
        return [(resp, restarts) for resp, (movable, restarts)
                in self._on.get(replica_id, {}).items() if movable()]

    @staticmethod
    def _count(streams: list[tuple[UpstreamResponse, bool]]) -> Moving:
        restarting = sum(restarts for _, restarts in streams)
        return Moving(len(streams) - restarting, restarting)

    def movable(self, replica_id: str) -> Moving:
        """The streams on `replica_id` that could move now."""
        here = self._count(self._here(replica_id))
        return here + self.peers.movable(replica_id) if self.peers is not None else here

    def evict(self, replica_id: str) -> Moving:
        """Interrupt every stream on `replica_id` that can move; those there were."""
        moving = self._here(replica_id)
        for resp, _ in moving:
            resp.interrupt(Evicted(f"replica {replica_id} drained"))
        here = self._count(moving)
        return here + self.peers.evict(replica_id) if self.peers is not None else here
