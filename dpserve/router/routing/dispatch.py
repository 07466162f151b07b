"""Where a request goes next: the replicas that may take it, the policy's pick,
the admission queue when every replica is full, and the per-replica breakers.

The proxy asks :meth:`Dispatcher.choose` for a replica before each attempt and
holds the returned :class:`Slot` (``with slot:``) while the attempt runs; the
slot owns the replica's in-flight count, the breaker permit and the wake-up of
the admission queue, and gives them back exactly once however the attempt ends
(an answer, an exception, a cancellation, a client gone), so no path can leak
any of them.

A replica may take a request when it is ready, its breaker lets requests
through, this request has not tried it yet, and it is under its in-flight cap.
When replicas are ready but all at their cap, the request waits in the
admission queue; when none is ready at all (or every breaker is open), it is
refused at once with 503 — waiting would only hide an outage. Except for a request
moving off a drained or failed replica (a stream's continuation, a restart), whose
client waits already: while a replica is coming into rotation (`coming`), it waits
in the same queue for one to be ready, `queue_timeout_s` at most.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Sequence
from types import TracebackType

from dpserve.config import RouterConfig
from dpserve.router.errors import RouterError
from dpserve.router.fleet.breaker import CircuitBreaker, Outcome, Permit
from dpserve.router.fleet.live import LiveStreams
from dpserve.router.fleet.pool import Replica, ReplicaPool, ReplicaState
from dpserve.router.routing.admission import (
    AdmissionQueue,
    AdmissionRejected,
    QueueTimeout,
    ewma,
    free_slots,
    retry_after_s,
    under_cap,
)
from dpserve.router.routing.canary import CanarySplit
from dpserve.router.routing.policies import Policy, RequestInfo

COMING = frozenset({ReplicaState.STARTING, ReplicaState.RELOADING})
"""States of a replica on its way into rotation: starting (or undrained, its checks
not passed yet), or hot-loading new weights in a rolling deploy."""

Waiting = Callable[[list[Replica]], None]
"""Told once, before a request waits for replicas coming into rotation, which ones."""


def logged_waiting(log: logging.Logger, request_id: str, to: str, timeout_s: float) -> Waiting:
    """A `Waiting` that says so in `log`: `request ID: no replica ready to TO; waiting up
    to S s for r0, coming into rotation`."""
    def waiting(coming: list[Replica]) -> None:
        log.info("request %s: no replica ready to %s; waiting up to %g s for %s, coming "
                 "into rotation", request_id, to, timeout_s, ", ".join(r.id for r in coming))
    return waiting


class Unavailable(RouterError):
    """No replica may take the request; carries the seconds for `Retry-After`."""

    def __init__(self, status: int, message: str, *, retry_after_s: int) -> None:
        super().__init__(status, message, retry_after_s=retry_after_s)


Uncached = Callable[[str, Sequence[int], str | None], int | None]
"""`(replica id, prompt token ids, adapter) -> tokens its engine must prefill`, or None."""


class Slot:
    """One attempt's hold on one replica, as a context manager.

    Entering counts the attempt in flight on the replica (and under its adapter, if
    it runs on one); releasing gives the count back, records `outcome` in the
    replica's circuit breaker, updates the mean service time (successes only) and
    wakes the admission queue. Set `outcome` as the attempt learns how it went; left
    unset, the attempt counts as aborted by the router (cancelled, client gone), which
    no breaker holds against a replica. Leaving the `with` block releases it; whoever
    learns first that the replica failed (a stream that broke mid-way) may release it
    early, so the breaker hears before the next replica is chosen. It is released
    once, whichever comes first.
    """

    __slots__ = ("_dispatcher", "adapter", "first_byte_s", "held", "outcome", "permit",
                 "prefill", "replica", "size", "started")

    def __init__(self, dispatcher: Dispatcher, replica: Replica, permit: Permit,
                 adapter: str | None = None, size: int = 0,
                 prefill: int | None = None) -> None:
        self._dispatcher = dispatcher
        self.size = size
        """The request body's bytes."""
        self.prefill = prefill
        """The prompt tokens the replica's engine had to compute afresh (its KV events
        held the rest), when known; only while a canary window is open."""
        self.replica = replica
        self.permit = permit
        self.adapter = adapter
        self.outcome = Outcome.ABORTED
        self.started = 0.0
        self.held = False
        self.first_byte_s: float | None = None
        """When its response began: seconds since the client's request arrived."""

    def __enter__(self) -> Slot:
        self.held = True
        self.replica.in_flight += 1
        if self.adapter is not None:
            counts = self.replica.adapters_in_flight
            counts[self.adapter] = counts.get(self.adapter, 0) + 1
        self.started = self._dispatcher._clock()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()

    def release(self) -> None:
        """Give the replica back and tell its breaker `outcome`; once (later calls do
        nothing)."""
        if not self.held:
            return
        self.held = False
        self.replica.in_flight -= 1
        if self.adapter is not None:
            counts = self.replica.adapters_in_flight
            left = counts.pop(self.adapter) - 1
            if left:
                counts[self.adapter] = left
        self._dispatcher._finished(self)


class Dispatcher:
    def __init__(self, pool: ReplicaPool, policy: Policy, config: RouterConfig, *,
                 clock: Callable[[], float] = time.monotonic,
                 uncached: Uncached | None = None) -> None:
        """`uncached`: the prompt tokens a replica must compute afresh, by its engine's
        KV events (`KVIndex.uncached_tokens`), for a canary's comparison of like with
        like; None when the router does not follow the events."""
        self._pool = pool
        self._uncached = uncached
        self._policy = policy
        self._config = config
        self._clock = clock
        self._cap = config.max_in_flight_per_replica or None
        self._breakers: dict[str, CircuitBreaker] = {}
        self._mean_service_s: float | None = None
        self.queue = AdmissionQueue(max_waiting=config.queue_size,
                                    timeout_s=config.queue_timeout_s)
        self.canary: CanarySplit | None = None
        """Set by a deploy's canary phase: a share of new requests for one replica."""
        self.streams = LiveStreams()
        """The migratable streams on each replica (a drain can move them)."""
        pool.on_state_change(self._on_state_change)

    @property
    def queueing(self) -> bool:
        """Whether requests may wait here (a per-replica cap is set)."""
        return self._cap is not None

    def breaker(self, replica: Replica) -> CircuitBreaker:
        b = self._breakers.get(replica.id)
        if b is None:
            b = self._breakers[replica.id] = CircuitBreaker(
                failure_threshold=self._config.breaker_failures,
                cooldown_s=self._config.breaker_cooldown_s)
        return b

    def _open_to(self, tried: Collection[str], adapter: str | None = None) -> list[Replica]:
        """Ready, breaker closed (or probing), not tried by this request, holding its
        adapter if it names one; cap ignored."""
        now = self._clock()
        return [r for r in self._pool.ready()
                if r.id not in tried and (adapter is None or adapter in r.models)
                and self.breaker(r).available(now)]

    def coming(self, request: RequestInfo, tried: Collection[str]) -> list[Replica]:
        """Replicas coming into rotation (`COMING`) that this request has not tried,
        holding its adapter if it names one."""
        adapter = request.adapter
        return [r for r in self._pool if r.state in COMING and r.id not in tried
                and (adapter is None or adapter in r.models)]

    def could_take(self, request: RequestInfo, tried: Collection[str]) -> bool:
        """Whether a replica this request has not tried is open to it, or coming:
        where a drain could move it (`choose` with `waiting`)."""
        return bool(self._open_to(tried, request.adapter) or self.coming(request, tried))

    async def choose(self, request: RequestInfo, tried: Collection[str], *,
                     waiting: Waiting | None = None) -> Slot:
        """A slot on the replica this attempt should use; waits in the admission queue
        while every open replica is at its cap. With `waiting` (a request moving off
        a drained or failed replica), also while none is open but one is coming into
        rotation, telling `waiting` first. Raises :class:`Unavailable`."""
        adapter = request.adapter
        if waiting is not None and not self._open_to(tried, adapter):
            coming = self.coming(request, tried)
            if coming:
                waiting(coming)
                await self._await_open(tried, adapter)
        if self._cap is not None and not under_cap(self._open_to(tried, adapter), self._cap):
            if not self._open_to(tried, adapter):
                raise self._nothing_open(tried)
            try:
                await self.queue.acquire(
                    lambda: free_slots(self._open_to(tried, adapter), self._cap))
            except AdmissionRejected as exc:
                slots = len(self._pool.ready()) * self._cap
                raise Unavailable(429, f"{exc}; retry later", retry_after_s=retry_after_s(
                    exc.waiting, slots=slots, mean_service_s=self._mean_service_s or 1.0,
                )) from None
        # No await from here on: the choice and the lease must see the same counts.
        candidates = under_cap(self._open_to(tried, adapter), self._cap)
        if self.canary is not None:
            candidates = self.canary.narrow(candidates, first_attempt=not tried)
        if any(r.avoid is not None for r in candidates):
            candidates = [r for r in candidates if r.avoid is None] or candidates
        replica = self._policy.select(candidates, request) if candidates else None
        permit = self.breaker(replica).allow(self._clock()) if replica is not None else None
        if replica is None or permit is None:
            raise self._nothing_open(tried)
        prefill = None
        if self.canary is not None and self._uncached is not None and request.tokens:
            prefill = self._uncached(replica.id, request.tokens, request.adapter)
        return Slot(self, replica, permit, adapter, request.size, prefill)

    async def _await_open(self, tried: Collection[str], adapter: str | None) -> None:
        """Wait in the admission queue for a replica to be open to this request (its
        turn to ready wakes the queue); Unavailable if none is within the timeout."""
        try:
            await self.queue.acquire(lambda: free_slots(self._open_to(tried, adapter),
                                                        self._cap))
        except QueueTimeout:
            raise Unavailable(503, f"no replica came into rotation within "
                                   f"{self.queue.timeout_s:g} s", retry_after_s=5) from None
        except AdmissionRejected as exc:
            raise Unavailable(503, str(exc), retry_after_s=1) from None

    def _nothing_open(self, tried: Collection[str]) -> Unavailable:
        if tried:
            return Unavailable(502, "no other replica is available to retry on",
                               retry_after_s=1)
        if not self._pool.ready():
            return Unavailable(503, "no replica is ready to serve requests; retry later",
                               retry_after_s=5)
        return Unavailable(503, "every ready replica is failing (circuit breakers open); "
                           "retry later", retry_after_s=max(1, round(
                               self._config.breaker_cooldown_s)))

    def _finished(self, slot: Slot) -> None:
        """A slot was left: the attempt's outcome goes to the breaker, its room to the queue."""
        now = self._clock()
        self.breaker(slot.replica).record(slot.permit, slot.outcome, now)
        if self.canary is not None:
            self.canary.record(slot.replica.id, slot.outcome, slot.first_byte_s, slot.size,
                               slot.prefill)
        if slot.outcome is Outcome.SUCCESS:
            self._mean_service_s = ewma(self._mean_service_s, now - slot.started)
        self.queue.notify()

    def _on_state_change(self, replica: Replica, old: ReplicaState, new: ReplicaState) -> None:
        if new is ReplicaState.READY:
            self.queue.notify()
