"""A per-replica circuit breaker: stop sending to a replica that keeps failing.

Health checks take a replica out after a few failed probes, seconds apart; a
replica whose `/health` still answers while its requests fail (a wedged
engine, an exhausted GPU) would keep receiving traffic. The breaker watches
the requests themselves::

    closed ──N consecutive failures──▶ open ──cooldown elapsed──▶ half-open
      ▲                                 ▲                            │
      │                                 └────── a probe fails ───────┤
      └────────────── `probes` probes succeed ───────────────────────┘

What counts (:func:`classify`): connection failures, timeouts, dropped
connections and 5xx are failures; 2xx/3xx are successes. A 4xx is neutral —
it neither counts nor resets the streak — because it is the request's fault:
it says the HTTP server is up but nothing about the engine, and a client
spamming malformed requests must not be able to hold a failing replica's
breaker closed. Requests the router abandons itself (the client left,
shutdown) are neutral too.

Consecutive failures rather than a failure ratio over a window: nothing to
size, the same behaviour at 1 and at 1,000 requests per second, and a
replica failing only some requests is left to retries and health checks.

Time is passed in (`now`, seconds on any monotonic clock), so the state
machine is pure and tested without sleeping. Every granted :class:`Permit`
must be given back to :meth:`CircuitBreaker.record` exactly once (use
`try/finally`): an unrecorded probe would hold the half-open slot forever.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from dpserve.router.upstream import client as upstream


class Outcome(enum.StrEnum):
    """How one attempt at one replica ended, as far as the replica is concerned."""

    SUCCESS = "success"
    """A 1xx-3xx response."""
    CLIENT_ERROR = "client_error"
    """A 4xx response: the request was refused, the replica works."""
    SERVER_ERROR = "server_error"
    """A 5xx response."""
    CONNECT_FAILED = "connect_failed"
    """No connection: refused, unreachable, name not resolved."""
    CONNECT_TIMEOUT = "connect_timeout"
    """No connection within the connect timeout."""
    DISCONNECTED = "disconnected"
    """The connection broke after it was made (before or during the response)."""
    TIMEOUT = "timeout"
    """Connected, but no response (or no next chunk) in time."""
    ABORTED = "aborted"
    """The router gave up on the attempt itself: client gone, shutdown, a router bug."""

    @property
    def is_failure(self) -> bool:
        """Counts against the replica."""
        return self in _FAILURES

    @property
    def is_success(self) -> bool:
        """Proves the replica serves."""
        return self is Outcome.SUCCESS


_FAILURES = frozenset({Outcome.SERVER_ERROR, Outcome.CONNECT_FAILED, Outcome.CONNECT_TIMEOUT,
                       Outcome.DISCONNECTED, Outcome.TIMEOUT})


def classify(status: int | None, error: BaseException | None) -> Outcome:
    """The outcome of an attempt that ended with `error`, else with response `status`.

    Errors are those of the data plane's client (`dpserve.router.upstream.client`). Order
    matters: its connect timeout is also a TimeoutError, and its connect failure
    and disconnect are OSErrors.
    """
    if error is not None:
        if isinstance(error, upstream.ConnectTimeout):
            return Outcome.CONNECT_TIMEOUT
        if isinstance(error, upstream.ConnectFailed):
            return Outcome.CONNECT_FAILED
        if isinstance(error, TimeoutError):
            return Outcome.TIMEOUT
        if isinstance(error, OSError):
            return Outcome.DISCONNECTED
        return Outcome.ABORTED  # CancelledError, KeyboardInterrupt, bugs: not the replica's doing
    if status is None:
        return Outcome.ABORTED
    if status >= 500:
        return Outcome.SERVER_ERROR
    if status >= 400:
        return Outcome.CLIENT_ERROR
    return Outcome.SUCCESS



class BreakerState(enum.StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True, slots=True)
class Permit:
    """Leave to send one request; hand it back to `record` with the outcome.

    `generation` ties the outcome to the state that granted it: results of
    requests sent before the breaker last changed state are ignored, so a slow
    request started while closed cannot decide a later probe.
    """

    generation: int
    probe: bool


class CircuitBreaker:
    """The breaker of one replica. Not thread-safe; the router is one event loop."""

    def __init__(self, *, failure_threshold: int = 5, cooldown_s: float = 10.0,
                 probes: int = 1) -> None:
        if failure_threshold < 1:
            raise ValueError(f"failure_threshold must be >= 1, got {failure_threshold}")
        if cooldown_s < 0:
            raise ValueError(f"cooldown_s must be >= 0, got {cooldown_s}")
        if probes < 1:
            raise ValueError(f"probes must be >= 1, got {probes}")
        self.failure_threshold = failure_threshold
        self.cooldown_s = cooldown_s
        self.probes = probes
        self._state = BreakerState.CLOSED
        self._generation = 0
        self._failures = 0
        self._opened_at = 0.0
        self._probes_granted = 0
        self._probe_successes = 0

    @property
    def consecutive_failures(self) -> int:
        return self._failures

    def state(self, now: float) -> BreakerState:
        """The state at `now` (an open breaker turns half-open once its cooldown is over)."""
        if self._state is BreakerState.OPEN and now - self._opened_at >= self.cooldown_s:
            self._enter(BreakerState.HALF_OPEN)
        return self._state

    def available(self, now: float) -> bool:
        """Whether `allow(now)` would grant a permit; grants nothing (for filtering candidates)."""
        state = self.state(now)
        return state is BreakerState.CLOSED or (
            state is BreakerState.HALF_OPEN and self._probes_granted < self.probes)

    def allow(self, now: float) -> Permit | None:
        """A permit to send one request now, or None while open (or while probes are out)."""
        if not self.available(now):
            return None
        probe = self._state is BreakerState.HALF_OPEN
        if probe:
            self._probes_granted += 1
        return Permit(self._generation, probe)

    def record(self, permit: Permit, outcome: Outcome, now: float) -> None:
        """The outcome of the request `permit` was granted for."""
        if permit.generation != self._generation:
            return
        if self._state is BreakerState.CLOSED:
            if outcome.is_failure:
                self._failures += 1
                if self._failures >= self.failure_threshold:
                    self._open(now)
            elif outcome.is_success:
                self._failures = 0
            return
        if self._state is BreakerState.HALF_OPEN and permit.probe:
            if outcome.is_failure:
                self._open(now)
            elif outcome.is_success:
                self._probe_successes += 1
                if self._probe_successes >= self.probes:
                    self._enter(BreakerState.CLOSED)
            else:  # neutral: the probe proved nothing; let another request probe
                self._probes_granted -= 1

    def _open(self, now: float) -> None:
        self._enter(BreakerState.OPEN)
        self._opened_at = now

    def _enter(self, state: BreakerState) -> None:
        self._state = state
        self._generation += 1
        self._failures = 0
        self._probes_granted = 0
        self._probe_successes = 0
