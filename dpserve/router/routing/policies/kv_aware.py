"""Routing on what the engines report they cache: their KV-cache events, kept in a
:class:`~dpserve.router.kv.index.KVIndex`, and their own load.

Each candidate's cost, in units of one request's work::

    cost = (1 - cached(r) / prompt) + load_weight * queue(r)

`cached(r)` is how many of the prompt's leading tokens replica `r` holds, in whole
blocks, by its own events or because this router (or a peer router) sent it a prompt
starting so, not yet reported (`forecast`, :mod:`dpserve.router.kv.forecast`);
`prompt` the prompt's length in tokens; `queue(r)` its requests running and waiting as
its engine last reported them, plus what this router and its peers sent it (or saw
finish) since (:func:`engine_queue`). Lowest cost wins; ties (nothing cached anywhere,
equal queues) go to the replica sent the least lately, by the fallback's count
(:meth:`PrefixAffinity.least`), with what peer routers say they sent, which
spreads new prefixes as evenly as round robin; every request is counted there once,
whichever decided it, so with data-plane workers the spreading is shared as the
fallback's is.

Both terms come from the engines: the events, and the queue as the engines count it,
seen by all routers alike. So two routers behind one address send a prefix where it is
cached, not each to its own guess (what
:class:`~dpserve.router.routing.policies.prefix_affinity.PrefixAffinity` must do).
What the events cannot tell them is what each sent since its last scrape, and that is
what places a prompt cached nowhere: two routers put 18-19% of such prompts on a replica
still prefilling another, one router 6% (~5% of mean TTFT; benchmarks/routing/README.md,
kv_ties). A prompt's blocks are published when the step that computed them ends, so a
prefill shows once it is done. Routers told of each other (`dpserve.router.peers`)
share that too: their in-flight counts, their recent work and the prompts they sent.

`load_weight` prices a queued request against a prefill: at 0.05 a replica holding a
whole prompt is preferred while it has fewer than twenty more requests queued than one
holding none. Like prefix affinity, replicas at the bounded-load cap (`load_factor` x
the fleet's average in flight) are left out first, so a stuck replica, whose in-flight
count climbs, is not sent more because of its cache.

When the events cannot decide, the request is placed by `fallback` (prefix affinity
by default) and the reason is counted: the prompt has no token ids (several prompts,
a body the tokenizer could not render exactly, tokenization off), or no candidate is
known to the index (no replica publishes events, all are stale after a gap). `stats`
says how often each happened: the fallback is visible, never silent. A request without
a prompt (the model list, `/tokenize`, embeddings) is no routing decision: it goes to
the replica sent the least lately, and is neither counted nor charged as work.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Sequence

from dpserve.router.fleet.pool import Replica
from dpserve.router.kv.decisions import (
    CACHED_BUCKETS,
    FALLBACK_REASONS,
    PROMPT_ROUTES,
    KVRoutingStats,
)
from dpserve.router.kv.forecast import Forecast
from dpserve.router.kv.index import KVIndex, PromptChain
from dpserve.router.routing.policies.base import RequestInfo
from dpserve.router.routing.policies.engine_load import engine_queue
from dpserve.router.routing.policies.prefix_affinity import PrefixAffinity
from dpserve.router.routing.policies.recent_work import under_cap

KV_LOAD_WEIGHT = 0.05
"""A queued request costs 0.05 of a full prefill: a replica with the whole prompt cached
is preferred while at most nineteen more requests are queued on it. Most of a queue is
decoding requests, each a millisecond or two of a step, not a prefill: at 0.5 a chat's
turns left their cached context for a replica two requests lighter, and recomputed it
(hit rate 58% against prefix affinity's 73%); at 0.15, tenants' short questions behind
2,000-token system prompts left their home for a queue seven shorter and recomputed
the prompt (hit rate 85.6% against 89.3%); at 0.05, 89.1%, chat 73.1% with the cache
fitting, and under cache pressure p99 TTFT 0.61x the best other policy's
(benchmarks/routing/README.md, kv_study)."""
KV_LOAD_FACTOR = 3.0
"""The bounded-load cap, as prefix affinity's (benchmarks/routing/README.md)."""
ENGINE_REPORT_MAX_AGE_S = 10.0
"""An engine report older than this is not believed: the router's own count is used."""
MAX_SENT_KEPT = 256
"""Prompts kept for peers between two reports (a report goes every few milliseconds);
past this, the oldest are not told: a peer then merely misses a forecast."""

SentPrompt = tuple[str, int, tuple[int, ...]]
"""(replica URL, block size, the chain keys of the prompt's full blocks)."""


class KVAware:
    """Replicas scored by exact cached-prefix length (KV events) and shared load."""

    name = "kv-aware"

    def __init__(self, index: KVIndex, *, fallback: PrefixAffinity,
                 load_weight: float = KV_LOAD_WEIGHT, load_factor: float = KV_LOAD_FACTOR,
                 forecast: Forecast | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`forecast`: the prompts this router sent that the engines have not reported,
        counted as held (kept in step with `index`: :meth:`KVIndex.forecast`); None
        routes on the events alone."""
        if load_weight < 0:
            raise ValueError(f"load_weight must be >= 0, got {load_weight}")
        if load_factor < 1.0:
            raise ValueError(f"load_factor must be >= 1.0, got {load_factor}")
        self.index = index
        self.fallback = fallback
        self.load_weight = load_weight
        self.load_factor = load_factor
        self._clock = clock
        self.forecast = forecast
        self.sent: list[SentPrompt] | None = None
        """Prompts placed since peers last took them (`take_sent`); None: nobody asks."""
        self.on_sent: Callable[[SentPrompt], None] | None = None
        """Told of each prompt placed and forecast (the router's other data-plane workers
        forecast it too: `dpserve.router.workers.kv_share`)."""
        self.needs: frozenset[str] = frozenset({"tokens", "engine_load"}) | fallback.needs
        self.stats = KVRoutingStats(fallbacks=dict.fromkeys(FALLBACK_REASONS, 0),
                                    cached_histogram=[0] * (len(CACHED_BUCKETS) + 1))

    def select(self, candidates: Sequence[Replica], request: RequestInfo) -> Replica | None:
        if not candidates:
            return None
        if request.route not in PROMPT_ROUTES:
            return self.fallback.least(under_cap(candidates, self.load_factor))
        tokens = request.tokens
        if not tokens:
            return self._fall_back(candidates, request, "no_tokens")
        now = self._clock()
        chain = PromptChain(tokens, request.adapter)
        held, expected = self.index.expected_tokens(chain, request.adapter, self.forecast,
                                                    now)
        if not any(r.id in held for r in candidates):
            return self._fall_back(candidates, request, "no_events")
        open_ = under_cap(candidates, self.load_factor)
        prompt = len(tokens)
        miss = {r.id: 1.0 - min(expected.get(r.id, 0), prompt) / prompt for r in open_}
        costs = {r.id: miss[r.id]
                 + self.load_weight * engine_queue(r, now, ENGINE_REPORT_MAX_AGE_S)
                 for r in open_}
        best = min(open_, key=lambda r: costs[r.id])
        # With peers, the others' counts are ~10 ms old: replicas holding as much of the
        # prompt as the best, with up to one queued request more, are tied, and the
        # tie-break spreads them by each router's share of the replicas, so that two
        # routers reading the same counts do not both pick their minimum.
        band = self.load_weight if self.fallback.peers is not None else 1e-9
        tied = [r for r in open_ if costs[r.id] <= costs[best.id] + band
                and miss[r.id] <= miss[best.id] + 1e-9]
        chosen = self.fallback.send(self.break_tie(tied) if len(tied) > 1 else tied[0])
        cached = min(held.get(chosen.id, 0), prompt)
        self._forecast(chosen, chain, cached, now)
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
        the least lately (by this router, its workers and its peers). A subclass may
        choose otherwise: what-ifs in benchmarks/routing/kv_ties.py."""
        return self.fallback.least(tied)

    def _forecast(self, chosen: Replica, chain: PromptChain, cached: int,
                  now: float) -> None:
        """Count the prompt's blocks that `chosen` does not hold yet (`cached` tokens it
        does) as held there until its engine reports them (or the forecast's time runs
        out), and keep them for peers. Blocks it holds already are left to the events:
        evicted later, they must stop counting then, not when a forecast expires."""
        forecast = self.forecast
        if forecast is None:
            return
        size = self.index.block_size(chosen.id)
        if size is None:
            return
        forecast.prune(now)
        keys = chain.keys(size)[cached // size:]  # matching hashed most of them
        if not keys:
            return
        forecast.add(chosen.id, keys, now)
        placed = (chosen.url, size, tuple(keys))
        self.keep_for_peers([placed])
        if self.on_sent is not None:
            self.on_sent(placed)

    def keep_for_peers(self, prompts: Sequence[SentPrompt]) -> None:
        """Keep `prompts` (placed here, or by this router's other workers) for the next
        report to peers, when there are peers."""
        sent = self.sent
        if sent is not None:
            sent.extend(prompts)
            if len(sent) > MAX_SENT_KEPT:
                del sent[:len(sent) - MAX_SENT_KEPT]

    def take_sent(self) -> list[SentPrompt]:
        """The prompts placed since the last call (the first call starts keeping them)."""
        sent, self.sent = self.sent or [], []
        return sent

    def _fall_back(self, candidates: Sequence[Replica], request: RequestInfo,
                   reason: str) -> Replica | None:
        assert self.stats.fallbacks is not None
        self.stats.fallbacks[reason] += 1
        return self.fallback.select(candidates, request)
