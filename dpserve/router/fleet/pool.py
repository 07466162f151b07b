"""The replica pool: who the replicas are, what state each is in, how busy each is.

State machine of a replica (the router only sends to `ready` ones)::

    starting ──health ok──▶ ready ──health fails / process died──▶ down
        ▲                    │  ▲                                   │
        │                    ▼  │                                   │
        │        draining / reloading (admin)                        │
        └───────────── supervisor restarts the process ◀─────────────┘

A replica's in-flight count is owned by the dispatcher's slot
(:class:`dpserve.router.routing.dispatch.Slot`), a context manager held for each attempt:
nothing else changes it, so a count can never leak on an error path.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field

from dpserve.router.fleet.engine_metrics import EngineLoad

log = logging.getLogger("dpserve.pool")


class ReplicaState(enum.StrEnum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    RELOADING = "reloading"
    DOWN = "down"


@dataclass(eq=False)
class Replica:
    """One vLLM engine server. `in_flight` is changed only by a dispatcher's slot."""

    id: str
    url: str
    device: str = "remote"
    """Where it runs: `gpu:0`, `cpu:0,1`, or `remote` for replicas started elsewhere."""
    state: ReplicaState = ReplicaState.STARTING
    weight_version: str | None = None
    models: frozenset[str] = frozenset()
    """Model names the replica serves, read from its /v1/models when it turns ready."""
    max_model_len: int | None = None
    """Its context length (vLLM's `max_model_len` in /v1/models); None: not reported."""
    in_flight: int = 0
    avoid: str | None = None
    """Why new requests should go elsewhere while another replica can take them (it is
    loading an adapter: its engine stops stepping meanwhile); None normally."""
    adapters_in_flight: dict[str, int] = field(default_factory=dict)
    """Of `in_flight`, the requests per LoRA adapter (engine name `NAME@VERSION`); an
    adapter is here exactly while some request for it runs on the replica."""
    health_successes: int = 0
    health_failures: int = 0
    state_since: float = field(default_factory=time.monotonic)
    last_error: str | None = None
    """Why it is out of rotation, or why its last health check failed; None once it is
    ready and its checks pass (a problem it recovered from is not shown)."""
    has_been_ready: bool = False
    """Whether it has been ready since it last entered `starting` (first start, restart,
    undrain): a health check that fails before that is a start-up probe, not a failure."""
    engine: EngineLoad | None = None
    """The engine's own report of its load at the last scrape of its /metrics."""
    engine_scraped_at: float | None = None
    """`time.monotonic()` of that scrape; None before the first one."""
    engine_in_flight_at_scrape: int = 0
    """The router's `in_flight` on this replica at that scrape, so a policy can add what
    the router sent (or saw finish) since then to the engine's possibly stale numbers."""
    peer_in_flight: int = 0
    """Requests other routers have in flight on it, as they last said
    (`dpserve.router.peers`); 0 without peers."""
    engine_peer_in_flight_at_scrape: int = 0
    """`peer_in_flight` at the last scrape."""

    def __repr__(self) -> str:
        return f"Replica({self.id}, {self.url}, {self.state.value}, in_flight={self.in_flight})"


StateListener = Callable[[Replica, ReplicaState, ReplicaState], None]
MembershipListener = Callable[[Replica], None]


class ReplicaPool:
    def __init__(self, replicas: list[Replica]) -> None:
        ids = [r.id for r in replicas]
        if len(set(ids)) != len(ids):
            raise ValueError(f"replica ids must be unique, got {ids}")
        self._replicas = list(replicas)
        self._listeners: list[StateListener] = []
        self._joined: list[MembershipListener] = []
        self._left: list[MembershipListener] = []
        self._leaving: list[Replica] = []
        self.settle: Callable[[], Awaitable[None]] | None = None
        """With data-plane workers: returns once every worker has applied the pool's
        state as it is now and reported its in-flight counts (`dpserve.router.workers`)."""

    def __iter__(self) -> Iterator[Replica]:
        return iter(self._replicas)

    def __len__(self) -> int:
        return len(self._replicas)

    def get(self, replica_id: str) -> Replica | None:
        return next((r for r in self._replicas if r.id == replica_id), None)

    def ready(self) -> list[Replica]:
        """Replicas that may receive new requests."""
        return [r for r in self._replicas if r.state is ReplicaState.READY]

    def served_models(self) -> frozenset[str]:
        """Model names known from ready replicas (empty until one has reported)."""
        names: frozenset[str] = frozenset()
        for r in self._replicas:
            if r.state is ReplicaState.READY:
                names |= r.models
        return names

    def reported_models(self) -> frozenset[str]:
        """Model names any replica in the pool reported last, whatever its state now:
        what a name must not collide with, whether or not a replica is ready."""
        names: frozenset[str] = frozenset()
        for r in self._replicas:
            names |= r.models
        return names

    def add(self, replica: Replica) -> None:
        """Put a replica found at run time (DNS discovery) into the pool, as it is."""
        if self.get(replica.id) is not None:
            raise ValueError(f"replica id {replica.id!r} is already in the pool")
        self._replicas.append(replica)
        for listener in self._joined:
            listener(replica)

    def remove(self, replica_id: str, reason: str) -> Replica | None:
        """Take a replica out of the pool for good (its engine is gone). It is marked
        down first, so listeners see it leave rotation; requests already on it keep
        their lease and finish."""
        replica = self.get(replica_id)
        if replica is None:
            return None
        self.set_state(replica, ReplicaState.DOWN, reason)
        self._replicas.remove(replica)
        self._leaving = [r for r in (*self._leaving, replica) if r.in_flight]
        for listener in self._left:
            listener(replica)
        return replica

    def leaving(self) -> list[Replica]:
        """Replicas removed from the pool whose requests have not all finished yet."""
        self._leaving = [r for r in self._leaving if r.in_flight]
        return list(self._leaving)

    def on_state_change(self, listener: StateListener) -> None:
        self._listeners.append(listener)

    def on_membership(self, joined: MembershipListener, left: MembershipListener) -> None:
        """Call `joined` for each replica added from now on and `left` for each removed
        (after it was marked down). Replicas already in the pool are the caller's to read."""
        self._joined.append(joined)
        self._left.append(left)

    def set_state(self, replica: Replica, state: ReplicaState, reason: str = "") -> None:
        old = replica.state
        if old is state:
            return
        replica.state = state
        replica.state_since = time.monotonic()
        if state is ReplicaState.READY:
            replica.has_been_ready = True
            replica.last_error = None
        else:
            replica.health_successes = 0
        if state is ReplicaState.STARTING:
            replica.has_been_ready = False
        if reason and state is ReplicaState.DOWN:
            replica.last_error = reason
        log.log(
            logging.WARNING if state is ReplicaState.DOWN else logging.INFO,
            "replica %s: %s -> %s%s", replica.id, old.value, state.value,
            f" ({reason})" if reason else "",
        )
        for listener in self._listeners:
            listener(replica, old, state)

    def mark_down(self, replica: Replica, reason: str) -> None:
        """Take a replica out of rotation now (process died, connection refused)."""
        if replica.state in (ReplicaState.READY, ReplicaState.STARTING):
            self.set_state(replica, ReplicaState.DOWN, reason)
        replica.health_successes = 0

    async def wait_idle(self, replica: Replica, within_s: float, *, at_most: int = 0,
                        poll_s: float = 0.05) -> bool:
        """Wait up to `within_s` for `replica` to have at most `at_most` requests in
        flight (default: nothing); whether it has. (Counts change in the data plane's
        slots, which signal nothing: poll.)"""
        deadline = time.monotonic() + within_s
        if self.settle is not None:  # other workers may not have seen the drain yet
            await self.settle()
        while replica.in_flight > at_most and time.monotonic() < deadline:
            await asyncio.sleep(poll_s)
        return replica.in_flight <= at_most

    def record_engine_load(self, replica: Replica, load: EngineLoad, now: float) -> None:
        """Store a scrape together with the router's in-flight count at the same instant."""
        replica.engine = load
        replica.engine_scraped_at = now
        replica.engine_in_flight_at_scrape = replica.in_flight
        replica.engine_peer_in_flight_at_scrape = replica.peer_in_flight
