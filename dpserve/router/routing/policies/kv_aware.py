"""Routing on what the engines report they cache: their KV-cache events, kept in a
:class:`~dpserve.router.kv.index.KVIndex`, and their own load.

Each candidate's cost, in units of one request's work::

    cost = (1 - cached(r) / prompt) + load_weight * queue(r)

`cached(r)` is how many of the prompt's leading tokens replica `r` holds, in whole
blocks, by its own events; `prompt` the prompt's length in tokens; `queue(r)` its
requests running and waiting as its engine last reported them, plus what this
router sent it (or saw finish) since (:func:`engine_queue`). Lowest cost wins; ties
(nothing cached anywhere, equal queues) go to the replica sent the least lately, by
the fallback's count (:meth:`PrefixAffinity.least`), which spreads new prefixes as
evenly as round robin; every request is counted there once, whichever decided it, so
with data-plane workers the spreading is shared as the fallback's is.

Both terms come from the engines: the events, and the queue as the engines count it,
seen by all routers alike. So two routers behind one address send a prefix where it is
cached, not each to its own guess (what
:class:`~dpserve.router.routing.policies.prefix_affinity.PrefixAffinity` must do).
What they do not share is what each sent since its last scrape, and that is what
places a prompt cached nowhere: two routers put 18-19% of such prompts on a replica still
prefilling another, one router 6% (~5% of mean TTFT; benchmarks/routing/README.md,
kv_ties). The events cannot tell them: a prompt's blocks are published when the step
that computed them ends, so a prefill shows once it is done.

`load_weight` prices a queued request against a prefill: at 0.15 a replica holding a
whole prompt is preferred while it has fewer than seven more requests queued than one
holding none. Like prefix affinity, replicas at the bounded-load cap (`load_factor` x
the fleet's average in flight) are left out first, so a stuck replica, whose in-flight
count climbs, is not sent more because of its cache.

When the events cannot decide, the request is placed by `fallback` (prefix affinity
by default) and the reason is counted: the prompt has no token ids (several prompts,
a body the tokenizer could not render exactly, tokenization off), or no candidate is
known to the index (no replica publishes events, all are stale after a gap). `stats`
says how often each happened: the fallback is visible, never silent.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Sequence

from dpserve.router.fleet.pool import Replica
from dpserve.router.kv.decisions import CACHED_BUCKETS, FALLBACK_REASONS, KVRoutingStats
from dpserve.router.kv.index import KVIndex
from dpserve.router.routing.policies.base import RequestInfo
from dpserve.router.routing.policies.engine_load import engine_queue
from dpserve.router.routing.policies.prefix_affinity import PrefixAffinity
from dpserve.router.routing.policies.recent_work import under_cap

KV_LOAD_WEIGHT = 0.15
"""A queued request costs 0.15 of a full prefill: a replica with the whole prompt cached
is preferred while at most six more requests are queued on it. Most of a queue is
decoding requests, each a millisecond or two of a step, not a prefill: at 0.5 a chat's
turns left their cached context for a replica two requests lighter, and recomputed it
(hit rate 58% against prefix affinity's 73%; at 0.1-0.2, 73%, and p99 TTFT under cache
pressure 0.66x the best other policy's: benchmarks/routing/README.md, kv_study)."""
KV_LOAD_FACTOR = 3.0
"""The bounded-load cap, as prefix affinity's (benchmarks/routing/README.md)."""
ENGINE_REPORT_MAX_AGE_S = 10.0
"""An engine report older than this is not believed: the router's own count is used."""


class KVAware:
    """Replicas scored by exact cached-prefix length (KV events) and shared load."""

    name = "kv-aware"

    def __init__(self, index: KVIndex, *, fallback: PrefixAffinity,
                 load_weight: float = KV_LOAD_WEIGHT, load_factor: float = KV_LOAD_FACTOR,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if load_weight < 0:
            raise ValueError(f"load_weight must be >= 0, got {load_weight}")
        if load_factor < 1.0:
            raise ValueError(f"load_factor must be >= 1.0, got {load_factor}")
        self.index = index
        self.fallback = fallback
        self.load_weight = load_weight
        self.load_factor = load_factor
        self._clock = clock
        self.needs: frozenset[str] = frozenset({"tokens", "engine_load"}) | fallback.needs
        self.stats = KVRoutingStats(fallbacks=dict.fromkeys(FALLBACK_REASONS, 0),
                                    cached_histogram=[0] * (len(CACHED_BUCKETS) + 1))

    def select(self, candidates: Sequence[Replica], request: RequestInfo) -> Replica | None:
        if not candidates:
            return None
        tokens = request.tokens
        if not tokens:
            return self._fall_back(candidates, request, "no_tokens")
        held = self.index.cached_tokens(tokens, request.adapter)
        if not any(r.id in held for r in candidates):
            return self._fall_back(candidates, request, "no_events")
        open_ = under_cap(candidates, self.load_factor)
        now = self._clock()
        prompt = len(tokens)
        costs = {r.id: (1.0 - min(held.get(r.id, 0), prompt) / prompt)
                 + self.load_weight * engine_queue(r, now, ENGINE_REPORT_MAX_AGE_S)
                 for r in open_}
        best = min(costs.values())
        tied = [r for r in open_ if costs[r.id] <= best + 1e-9]
        chosen = self.fallback.send(self.break_tie(tied) if len(tied) > 1 else tied[0])
        cached = min(held.get(chosen.id, 0), prompt)
        stats = self.stats
        stats.on_events += 1
        stats.prompt_tokens += prompt
        stats.cached_tokens += cached
        stats.last_cached_tokens = cached
        assert stats.cached_histogram is not None
        stats.cached_histogram[bisect.bisect_left(CACHED_BUCKETS, cached)] += 1
        return chosen

    def break_tie(self, tied: Sequence[Replica]) -> Replica:
        """Of several replicas of equal cost (nothing cached, equal queues), the one sent
        the least lately (by this router, and its workers). A subclass may choose
        otherwise: what-ifs in benchmarks/routing/kv_ties.py."""
        return self.fallback.least(tied)

    def _fall_back(self, candidates: Sequence[Replica], request: RequestInfo,
                   reason: str) -> Replica | None:
        assert self.stats.fallbacks is not None
        self.stats.fallbacks[reason] += 1
        return self.fallback.select(candidates, request)
