"""Spread new work by what each replica was sent lately, within a bound on in-flight.

A request's time to first token is mostly the prefill queued ahead of it on its
replica, and that queue is what the router sent there in the last second or
two. The in-flight count cannot see it: it is dominated by long-running decodes
(tens per replica), and moves by one when a request arrives and by one when
another finishes. So two random choices by in-flight count put two fresh
prompts on one replica about as often as a random pick would, and with uniform
prompts lose to round robin (p99 TTFT 449 ms against 240 ms, 8 simulated
replicas, benchmarks/routing/README.md).

:class:`RecentWork` keeps, per replica, the work sent to it with exponential
decay (half-life `half_life_s`): each request counts one unit. New work goes to
the replica with the least, among those whose in-flight count is under the
bounded-load cap of :func:`~dpserve.router.routing.policies.consistent_hash.capacity` —
the cap is what keeps a slow or stuck replica, whose in-flight count climbs,
from being sent its share regardless. With equal requests this is round robin;
when a replica was just sent extra (an affinity key's home), the others catch up.
Ties (an idle fleet) go to the next replica in id order after the last chosen.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

from dpserve.router.fleet.pool import Replica
from dpserve.router.routing.policies.consistent_hash import capacity

DEFAULT_HALF_LIFE_S = 2.0
"""About the time a replica takes to work through a burst of prefills; the choice
is insensitive to it between 1 and 30 s on the simulated fleet."""
MIN_CAP = 4
"""The cap never drops below this. On a nearly idle fleet bounded loads cap a replica
at 1, so a prefix's second concurrent request would leave its home (and miss its
cache) although no engine is anywhere near full; an engine runs a few requests per
step at about the cost of one."""
MAX_TRACKED = 1024
"""Past this many replica ids, those whose work has decayed to nothing are dropped."""


def under_cap(candidates: Sequence[Replica], load_factor: float) -> list[Replica]:
    """Candidates under the bounded-load cap (at least MIN_CAP); never empty when
    `candidates` is not, since the least loaded is at or below the average."""
    cap = max(MIN_CAP, capacity(sum(r.in_flight for r in candidates), len(candidates),
                                load_factor))
    return [r for r in candidates if r.in_flight < cap] or list(candidates)


class RecentWork:
    """Decayed count of requests sent to each replica, and the least-sent choice."""

    def __init__(self, *, half_life_s: float = DEFAULT_HALF_LIFE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if half_life_s <= 0:
            raise ValueError(f"half_life_s must be > 0, got {half_life_s}")
        self._rate = math.log(2) / half_life_s
        self._clock = clock
        self._sent: dict[str, tuple[float, float]] = {}
        """Replica id -> (decayed work, when it was last updated)."""
        self._last: tuple[int, str] | None = None

    def work(self, replica: Replica, now: float) -> float:
        """What `replica` was sent lately, decayed to `now`."""
        value, at = self._sent.get(replica.id, (0.0, now))
        return value * math.exp(-self._rate * (now - at))

    def least(self, candidates: Sequence[Replica],
              extra: Callable[[Replica], float] | None = None) -> Replica:
        """The candidate sent the least lately (plus `extra(replica)`: work others say
        they sent); ties go in id order after the last one chosen. `candidates` must not
        be empty."""
        now = self._clock()
        ordered = sorted(candidates, key=_order)
        last = self._last
        start = next((i for i, r in enumerate(ordered) if last is not None and _order(r) > last),
                     0)
        turn = ordered[start:] + ordered[:start]
        if extra is None:
            return min(turn, key=lambda r: self.work(r, now))
        return min(turn, key=lambda r: self.work(r, now) + extra(r))

    def charge(self, replica: Replica, units: float = 1.0) -> None:
        """Count `units` of new work sent to `replica`, now."""
        self.add(replica.id, units)
        self._last = _order(replica)

    def add(self, replica_id: str, units: float) -> None:
        """Count `units` of work sent to `replica_id` by someone else (another worker)."""
        now = self._clock()
        value, at = self._sent.get(replica_id, (0.0, now))
        self._sent[replica_id] = (value * math.exp(-self._rate * (now - at)) + units, now)
        if len(self._sent) > MAX_TRACKED:
            self._forget(now)

    def _forget(self, now: float) -> None:
        """Drop replicas whose work has decayed to nothing (ids that left the fleet)."""
        for rid, (value, at) in list(self._sent.items()):
            if value * math.exp(-self._rate * (now - at)) < 1e-6:
                del self._sent[rid]


def _order(replica: Replica) -> tuple[int, str]:
    """Natural order of ids: r2 before r10."""
    return (len(replica.id), replica.id)
