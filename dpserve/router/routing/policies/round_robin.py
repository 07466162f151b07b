from __future__ import annotations

from collections.abc import Sequence

from dpserve.router.fleet.pool import Replica
from dpserve.router.routing.policies.base import RequestInfo


def _order(replica: Replica) -> tuple[int, str]:
    """Natural order of ids: r2 before r10."""
    return (len(replica.id), replica.id)


class RoundRobin:
    """Each candidate in turn, in id order, resuming after the last one chosen.

    The turn is remembered by replica id, not list index, so a replica leaving
    rotation does not shift everybody else's turn.
    """

    name = "round-robin"
    needs: frozenset[str] = frozenset()

    def __init__(self) -> None:
        self._last: tuple[int, str] | None = None

    def select(self, candidates: Sequence[Replica], request: RequestInfo) -> Replica | None:
        if not candidates:
            return None
        ordered = sorted(candidates, key=_order)
        chosen = ordered[0]
        if self._last is not None:
            chosen = next((r for r in ordered if _order(r) > self._last), ordered[0])
        self._last = _order(chosen)
        return chosen
