"""Blocks a router sent to a replica that its engine has not reported yet.

vLLM publishes a prompt's blocks at the end of the step that computed them, so for the
time a prompt waits and prefills (tens of milliseconds idle, seconds under load) the
index says its replica holds nothing of it. A second request with the same prefix in
that window (a tenant's next question behind one system prompt, a burst of agents on one
context) then looks cached nowhere and is placed by load, usually elsewhere, where it
computes the prefix again: on the `tenants` workload that took kv-aware's hit rate to
86.2% against prefix affinity's 89.4% (benchmarks/routing/README.md, quality_kv).

A :class:`Forecast` keeps, per replica, the chain keys of the prompts sent there, each
until `ttl_s` passes or the engine reports the block stored: the index removes a key
from every forecast the moment it is stored (:meth:`KVIndex.apply`), so once the engine
speaks for a block the forecast never does again, and a block stored and later evicted
is not brought back by a forecast (which is what routing every new prompt by prefix
affinity did under cache pressure: p99 1.39x the best peer's). An `AllBlocksCleared`,
a restart or a dropped replica clears its forecast too.

A forecast is the router's own (and its peers', `dpserve.router.peers`): it is what
this router knows that the engines have not said yet. It is bounded per replica
(`max_keys`, oldest first).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable

DEFAULT_TTL_S = 10.0
"""How long a sent block counts as held before its engine reports it: longer than a
prefill queued behind a few others on a loaded replica (~1-5 s on the simulated fleet
under pressure), short enough that a request that failed before its prefill (an
aborted client, a replica that died) misleads for seconds, not minutes."""
DEFAULT_MAX_KEYS = 200_000
"""Keys kept per replica: 100 requests a second of 2,000-token prompts in 16-token blocks
for 10 s is 125k; past it, the oldest are forgotten (a forecast only ever adds hits)."""


class Forecast:
    """Chain keys sent to each replica and not yet reported stored, with their expiry.
    Build it with :meth:`KVIndex.forecast`, which keeps it in step with the events."""

    def __init__(self, *, ttl_s: float = DEFAULT_TTL_S,
                 max_keys: int = DEFAULT_MAX_KEYS) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        if max_keys < 1:
            raise ValueError(f"max_keys must be >= 1, got {max_keys}")
        self.ttl_s = ttl_s
        self.max_keys = max_keys
        self.replicas: dict[Hashable, OrderedDict[int, float]] = {}
        """Replica id -> chain key -> when it stops counting (the clock's time)."""

    def add(self, replica_id: Hashable, keys: Iterable[int], now: float) -> None:
        """Count `keys` (a prompt's leading blocks' chain keys) as held by `replica_id`
        until `now + ttl_s`."""
        until = now + self.ttl_s
        held = self.replicas.get(replica_id)
        if held is None:
            held = self.replicas[replica_id] = OrderedDict()
        for key in keys:
            held[key] = until
            held.move_to_end(key)
        while len(held) > self.max_keys:
            held.popitem(last=False)

    def holds(self, replica_id: Hashable) -> OrderedDict[int, float] | None:
        """The keys forecast for `replica_id` (expired ones included: compare with the
        clock), or None."""
        return self.replicas.get(replica_id)

    def stored(self, replica_id: Hashable, keys: Iterable[int]) -> None:
        """The engine reported these blocks: its events speak for them from now on."""
        held = self.replicas.get(replica_id)
        if held:
            for key in keys:
                held.pop(key, None)

    def clear(self, replica_id: Hashable) -> None:
        self.replicas.pop(replica_id, None)

    def prune(self, now: float) -> None:
        """Forget expired keys (they are ignored anyway; this bounds memory between
        requests). Keys are kept in the order they were added, so expired ones are first."""
        for rid, held in list(self.replicas.items()):
            while held:
                key, until = next(iter(held.items()))
                if until > now:
                    break
                del held[key]
            if not held:
                del self.replicas[rid]

    def size(self) -> int:
        return sum(len(held) for held in self.replicas.values())
