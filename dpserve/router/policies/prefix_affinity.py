from __future__ import annotations

import random
from collections.abc import Sequence

from dpserve.router.policies.base import RequestInfo
from dpserve.router.policies.consistent_hash import (
    DEFAULT_LOAD_FACTOR,
    DEFAULT_VNODES,
    BoundedLoadHash,
)
from dpserve.router.policies.keys import DEFAULT_PREFIX_CHARS
from dpserve.router.policies.least_outstanding import LeastOutstanding
from dpserve.router.pool import Replica


class PrefixAffinity:
    """Requests whose prompts start alike on one replica, while it is not overloaded.

    vLLM reuses the KV blocks of a prefix it has already computed; many requests
    share a system prompt or few-shot preamble, so sending them to one replica
    turns their prefill into cache hits. The key is the model name and the
    first `prefix_chars` characters of `RequestInfo.prefix` — a cheap stand-in
    for a token-level prefix tree. Bounded loads spill a hot prefix onto the
    next replicas on the ring instead of queueing it on one. Requests without a
    prefix go to the less loaded of two random replicas.
    """

    name = "prefix-affinity"

    def __init__(self, *, prefix_chars: int = DEFAULT_PREFIX_CHARS,
                 load_factor: float = DEFAULT_LOAD_FACTOR, vnodes: int = DEFAULT_VNODES,
                 rng: random.Random | None = None) -> None:
        if prefix_chars < 1:
            raise ValueError(f"prefix_chars must be >= 1, got {prefix_chars}")
        self.prefix_chars = prefix_chars
        self._hash = BoundedLoadHash(load_factor=load_factor, vnodes=vnodes)
        self._fallback = LeastOutstanding(rng=rng)

    def select(self, candidates: Sequence[Replica], request: RequestInfo) -> Replica | None:
        if not request.prefix:
            return self._fallback.select(candidates, request)
        key = f"{request.model or ''}\0{request.prefix[: self.prefix_chars]}"
        return self._hash.select(candidates, key)
