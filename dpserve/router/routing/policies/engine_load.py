from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence

from dpserve.router.fleet.engine_metrics import EngineLoad
from dpserve.router.fleet.pool import Replica
from dpserve.router.routing.policies.base import RequestInfo


def fresh_report(replica: Replica, now: float, max_age_s: float) -> EngineLoad | None:
    """The engine's last report of its load, if it has one no older than `max_age_s`
    that counts its requests; None otherwise (the router's own count must do)."""
    load, at = replica.engine, replica.engine_scraped_at
    if load is None or at is None or now - at > max_age_s or load.num_requests is None:
        return None
    return load


def engine_queue(replica: Replica, now: float, max_age_s: float) -> float:
    """Requests queued on `replica` (running and waiting): its engine's last report
    plus the in-flight change since of this router and its peers (0 without), never
    below their in-flight count; that count alone when the report is missing or stale
    (`fresh_report`)."""
    routed = replica.in_flight + replica.peer_in_flight
    load = fresh_report(replica, now, max_age_s)
    if load is None or load.num_requests is None:
        return float(routed)
    since = routed - replica.engine_in_flight_at_scrape - replica.engine_peer_in_flight_at_scrape
    return float(max(load.num_requests + since, routed))


class EngineLoadPolicy:
    """Power of two choices over a load score that joins what the engine last
    reported with what the router has done since.

    Score, in units of requests::

        queue = max(running + waiting at the scrape
                    + (in_flight now - in_flight at the scrape), in_flight now)
        score = queue + waiting_weight * waiting + kv_weight * kv_cache_usage

    The engine's numbers see what the router cannot: requests from other
    routers, requests queued for lack of KV space, a nearly full cache that
    is about to preempt. But they are as old as the last scrape. Adding the
    router's own in-flight change since the scrape is what prevents a herd:
    a lease raises the chosen replica's score before the next request is
    placed, so a burst cannot all pile onto the replica that looked idle a
    second ago. Two random choices add the same protection across several
    router processes, which do not see each other's leases (Mitzenmacher,
    "How Useful Is Old Information?"). Waiting requests weigh extra because
    they mean the engine is out of capacity, not just busy.

    A replica never scraped, or scraped more than `max_age_s` ago, scores its
    in-flight count alone, so a broken metrics endpoint cannot pin an old
    "busy" reading on it forever.
    """

    name = "engine-load"
    needs: frozenset[str] = frozenset({"engine_load"})  # the engines' scraped load

    def __init__(self, *, waiting_weight: float = 1.0, kv_weight: float = 2.0,
                 max_age_s: float = 10.0, clock: Callable[[], float] = time.monotonic,
                 rng: random.Random | None = None) -> None:
        self.waiting_weight = waiting_weight
        self.kv_weight = kv_weight
        self.max_age_s = max_age_s
        self._clock = clock
        self._rng = rng or random.Random()

    def score(self, replica: Replica, now: float) -> float:
        """Estimated load of `replica` at `now`; lower is better."""
        load = fresh_report(replica, now, self.max_age_s)
        if load is None:
            return float(replica.in_flight)
        return (engine_queue(replica, now, self.max_age_s)
                + self.waiting_weight * (load.num_requests_waiting or 0)
                + self.kv_weight * (load.kv_cache_usage_perc or 0.0))

    def select(self, candidates: Sequence[Replica], request: RequestInfo) -> Replica | None:
        if len(candidates) < 2:
            return candidates[0] if candidates else None
        now = self._clock()
        i, j = self._rng.sample(range(len(candidates)), 2)
        first, second = candidates[i], candidates[j]
        return second if self.score(second, now) < self.score(first, now) else first
