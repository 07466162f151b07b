"""The health checks' decision, apart from their I/O: flip only after a streak.

One lost probe (a GC pause, a busy event loop) must not take a replica out of
rotation, and one lucky probe must not put a crashing one back in. So a ready
replica goes down after `down_after` consecutive failures, and a starting or
down one comes up after `up_after` consecutive successes. A result of the other
kind resets the streak.
"""

from __future__ import annotations

from typing import NamedTuple

from dpserve.router.fleet.pool import ReplicaState

CHECKED = frozenset({ReplicaState.STARTING, ReplicaState.READY, ReplicaState.DOWN})
"""States the health checks decide; draining and reloading belong to the admin path."""


class Verdict(NamedTuple):
    state: ReplicaState
    """The state the replica should be in after this result."""
    successes: int
    """Consecutive successful checks, this one included."""
    failures: int
    """Consecutive failed checks, this one included."""


def next_state(current: ReplicaState, ok: bool, successes: int, failures: int, *,
               down_after: int, up_after: int) -> Verdict:
    """Record one check result (`ok`) on top of the streak counts so far.

    States outside :data:`CHECKED` are returned unchanged, counts included.
    """
    if current not in CHECKED:
        return Verdict(current, successes, failures)
    if ok:
        successes, failures = successes + 1, 0
        if current is not ReplicaState.READY and successes >= up_after:
            return Verdict(ReplicaState.READY, successes, failures)
        return Verdict(current, successes, failures)
    successes, failures = 0, failures + 1
    if current is ReplicaState.READY and failures >= down_after:
        return Verdict(ReplicaState.DOWN, successes, failures)
    return Verdict(current, successes, failures)
