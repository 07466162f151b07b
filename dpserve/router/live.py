"""The migratable streams running on each replica, so a drain can move them on cue.

A stream registers its upstream response for as long as it relays it
(`dpserve.router.migration`). `evict(replica)` interrupts every one on that
replica with `Evicted`: each relay then sees its replica's stream break and moves
it to another replica, exactly as if the replica had died (reason `drained`). A
rolling deploy calls it when a drained replica's requests are still running at
the drain deadline, so that they finish elsewhere instead of being frozen by the
pause and resumed on the new weights.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Protocol

from dpserve.router.http1 import Disconnected, UpstreamResponse


class Evicted(Disconnected):
    """The router took the stream off its replica (drained with a deadline)."""


class Peers(Protocol):
    """The streams other data-plane workers run (`dpserve.router.workers`)."""

    def movable(self, replica_id: str) -> int: ...

    def evict(self, replica_id: str) -> int: ...


class LiveStreams:
    def __init__(self) -> None:
        self._on: dict[str, dict[UpstreamResponse, Callable[[], bool]]] = {}
        self.peers: Peers | None = None
        """Other workers' streams, counted and evicted with this worker's."""

    @contextlib.contextmanager
    def running(self, replica_id: str, resp: UpstreamResponse,
                movable: Callable[[], bool]) -> Iterator[None]:
        """While relaying `resp` from `replica_id`; `movable()` says whether the stream
        could move now (its prompt ids came, no limit reached)."""
        streams = self._on.setdefault(replica_id, {})
        streams[resp] = movable
        try:
            yield
        finally:
            del streams[resp]
            if not streams:
                del self._on[replica_id]

    def replicas(self) -> list[str]:
        """The replicas with a stream running here."""
        return list(self._on)

    def movable(self, replica_id: str) -> int:
        """How many streams on `replica_id` could move now."""
        here = sum(movable() for movable in self._on.get(replica_id, {}).values())
        return here + (self.peers.movable(replica_id) if self.peers is not None else 0)

    def evict(self, replica_id: str) -> int:
        """Interrupt every stream on `replica_id` that can move; how many there were."""
        moving = [r for r, movable in self._on.get(replica_id, {}).items() if movable()]
        for resp in moving:
            resp.interrupt(Evicted(f"replica {replica_id} drained"))
        return len(moving) + (self.peers.evict(replica_id) if self.peers is not None else 0)
