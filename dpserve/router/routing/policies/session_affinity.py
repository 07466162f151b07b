from __future__ import annotations

import random
from collections.abc import Sequence

from dpserve.router.fleet.pool import Replica
from dpserve.router.routing.policies.base import RequestInfo
from dpserve.router.routing.policies.consistent_hash import (
    DEFAULT_LOAD_FACTOR,
    DEFAULT_VNODES,
    BoundedLoadHash,
)
from dpserve.router.routing.policies.least_outstanding import LeastOutstanding


class SessionAffinity:
    """Requests of one session (`RequestInfo.session_id`) on one replica, while it
    is not overloaded.

    A multi-turn conversation resends its history every turn; on the replica
    that served the previous turn that history is already in the prefix cache.
    Consistent hashing with bounded loads keeps a chatty session from burying
    its replica, and moves few sessions when the fleet changes. Requests
    without a session go to the less loaded of two random replicas.
    """

    name = "session-affinity"
    needs: frozenset[str] = frozenset({"session_id"})

    def __init__(self, *, load_factor: float = DEFAULT_LOAD_FACTOR,
                 vnodes: int = DEFAULT_VNODES, rng: random.Random | None = None) -> None:
        self._hash = BoundedLoadHash(load_factor=load_factor, vnodes=vnodes)
        self._fallback = LeastOutstanding(rng=rng)

    def select(self, candidates: Sequence[Replica], request: RequestInfo) -> Replica | None:
        if not request.session_id:
            return self._fallback.select(candidates, request)
        return self._hash.select(candidates, request.session_id)
