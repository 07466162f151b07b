from __future__ import annotations

import random
from collections.abc import Sequence

from dpserve.router.fleet.pool import Replica
from dpserve.router.routing.policies.base import RequestInfo


class LeastOutstanding:
    """Power of two choices: of two distinct candidates drawn at random, the one
    with fewer requests in flight (counted by the router); on a tie, the first drawn.

    Why not the global minimum: several routers (or one router acting on
    counts that lag by a request) all sending to the single least-loaded
    replica herd onto it; two random choices keep the maximum load within
    O(log log n) of the average while never picking the busiest replica
    (Mitzenmacher, "The Power of Two Choices in Randomized Load Balancing").
    Ties are broken by draw order, which is itself random, so bursts at low
    load spread instead of piling onto replica 0.
    """

    name = "least-outstanding"
    needs: frozenset[str] = frozenset()

    def __init__(self, *, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def select(self, candidates: Sequence[Replica], request: RequestInfo) -> Replica | None:
        if len(candidates) < 2:
            return candidates[0] if candidates else None
        i, j = self._rng.sample(range(len(candidates)), 2)
        first, second = candidates[i], candidates[j]
        return second if second.in_flight < first.in_flight else first
