from __future__ import annotations

import random
from collections.abc import Sequence

from dpserve.router.policies.base import RequestInfo
from dpserve.router.pool import Replica


class LeastOutstanding:
    """Fewest requests in flight (counted by the router); ties broken at random.

    Random tie-breaking matters at low load, when most replicas sit at zero:
    always taking the first idle one would pile bursts onto replica 0.
    """

    name = "least-outstanding"

    def __init__(self, *, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def select(self, candidates: Sequence[Replica], request: RequestInfo) -> Replica | None:
        if not candidates:
            return None
        least = min(r.in_flight for r in candidates)
        tied = [r for r in candidates if r.in_flight == least]
        return tied[0] if len(tied) == 1 else self._rng.choice(tied)
