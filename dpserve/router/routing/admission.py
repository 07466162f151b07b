"""Admission: cap each replica's requests in flight, and queue briefly when all are full.

Past a point, another request on a vLLM engine only lengthens everyone's
latency: it waits in the engine's queue, or preempts others when the KV cache
runs out. With `max_in_flight` per replica the router holds the excess
instead, in one FIFO line shared by all replicas, where it can still go to
whichever replica frees up first, and from which it is refused with a
`Retry-After` when the line is full or the wait too long — a clear answer
instead of a timeout.

The decisions are pure functions; :class:`AdmissionQueue` is the waiting line,
built on asyncio futures. The caller wakes it with :meth:`AdmissionQueue.notify`
whenever capacity may have appeared (a lease ended, a replica turned ready).
"""

from __future__ import annotations

import asyncio
import collections
import enum
import math
from collections.abc import Callable, Sequence

from dpserve.router.fleet.pool import Replica


class Admission(enum.StrEnum):
    ADMIT = "admit"
    QUEUE = "queue"
    REJECT = "reject"


def under_cap(candidates: Sequence[Replica], max_in_flight: int | None) -> list[Replica]:
    """Candidates that may take one more request (all of them without a cap)."""
    if max_in_flight is None:
        return list(candidates)
    return [r for r in candidates if r.in_flight < max_in_flight]


def free_slots(candidates: Sequence[Replica], max_in_flight: int | None) -> int:
    """Requests the candidates could start now. Without a cap, one per candidate:
    enough to say whether a request can start, which is all admission asks."""
    if max_in_flight is None:
        return len(candidates)
    return sum(max(0, max_in_flight - r.in_flight) for r in candidates)


def decide(free: int, waiting: int, max_waiting: int) -> Admission:
    """Start now only if a slot is free and nobody is ahead in line (first come,
    first served); else wait if the line has room; else refuse."""
    if free > 0 and waiting == 0:
        return Admission.ADMIT
    if waiting < max_waiting:
        return Admission.QUEUE
    return Admission.REJECT


def retry_after_s(waiting: int, *, slots: int, mean_service_s: float,
                  floor_s: int = 1, ceiling_s: int = 60) -> int:
    """Seconds a refused client should wait (the HTTP `Retry-After` value).

    The time for the line ahead of it to drain: `(waiting + 1)` requests over
    `slots` parallel slots, each held `mean_service_s` on average; rounded up
    and kept within [floor_s, ceiling_s]. With no slot at all (no replica ready)
    it is `ceiling_s`: a replica takes tens of seconds to start.
    """
    if slots <= 0:
        return ceiling_s
    estimate = math.ceil((waiting + 1) * max(mean_service_s, 0.0) / slots)
    return min(ceiling_s, max(floor_s, estimate))


def ewma(previous: float | None, sample: float, alpha: float = 0.1) -> float:
    """Exponentially weighted mean (e.g. of request durations, for `mean_service_s`)."""
    return sample if previous is None else previous + alpha * (sample - previous)


class AdmissionRejected(Exception):
    """The request was not admitted; `waiting` is the line's length at that moment."""

    def __init__(self, message: str, *, waiting: int) -> None:
        super().__init__(message)
        self.waiting = waiting


class QueueFull(AdmissionRejected):
    """Every replica was at its cap and the line was full."""


class QueueTimeout(AdmissionRejected):
    """The request waited in line for the whole timeout without a slot freeing."""


class AdmissionQueue:
    """A first-come-first-served line for requests that found every replica full.

    :meth:`acquire` returns when the caller may start its request; the caller
    must take its lease before its next `await`, so nobody else claims the slot
    meanwhile. Each :meth:`notify` wakes the head of the line; a waiter that
    gets in wakes the next, so several freed slots fill in turn.
    """

    def __init__(self, *, max_waiting: int, timeout_s: float) -> None:
        if max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {max_waiting}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.max_waiting = max_waiting
        self.timeout_s = timeout_s
        self._sleepers: collections.deque[asyncio.Future[None]] = collections.deque()
        self._waiting = 0

    @property
    def waiting(self) -> int:
        """Requests in line, including any woken but not yet resumed."""
        return self._waiting

    def notify(self) -> None:
        """Capacity may have appeared: let the head of the line look."""
        while self._sleepers:
            sleeper = self._sleepers.popleft()
            if not sleeper.done():
                sleeper.set_result(None)
                return

    async def acquire(self, free_slots: Callable[[], int]) -> None:
        """Return once `free_slots()` is positive and this request is first in line.

        Raises :class:`QueueFull` at once if the line is full, or
        :class:`QueueTimeout` after `timeout_s` in line.
        """
        decision = decide(free_slots(), self._waiting, self.max_waiting)
        if decision is Admission.ADMIT:
            return
        if decision is Admission.REJECT:
            raise QueueFull("every replica is at its limit and the queue is full",
                            waiting=self._waiting)
        loop = asyncio.get_running_loop()
        sleeper: asyncio.Future[None] = loop.create_future()
        self._sleepers.append(sleeper)
        self._waiting += 1
        try:
            async with asyncio.timeout(self.timeout_s):
                while True:
                    await sleeper
                    if free_slots() > 0:
                        return
                    # Woken, but the slot is gone (or never was): back to the head.
                    sleeper = loop.create_future()
                    self._sleepers.appendleft(sleeper)
        except TimeoutError:
            raise QueueTimeout(f"no replica had room within {self.timeout_s:g} s",
                               waiting=self._waiting) from None
        finally:
            self._waiting -= 1
            if sleeper.done() and not sleeper.cancelled():
                # Woken: whether we got in or left anyway, the next one may have room too.
                self.notify()
            elif sleeper in self._sleepers:
                self._sleepers.remove(sleeper)
