"""Rates and percentiles over the last minute, from successive scrapes.

A scrape holds counters (tokens generated since the engine started) and a
cumulative histogram (every first token the engine ever timed). What a person
watching wants is the last minute, so :class:`History` keeps the scrapes of the
last `WINDOW_S` seconds, and each figure is the difference between the newest
scrape and the oldest one in the window that has that replica's series:

- tokens/s: counter delta / time between the two scrapes;
- TTFT p50/p99: the quantile of the histogram's bucket deltas, interpolated
  within a bucket as Prometheus' `histogram_quantile` does;
- prefix hit: the engine's prefix-cache hits delta / queries delta (tokens);
- under `kv-aware`, the fleet's :class:`KVSummary`: the share of the router's
  decisions made on KV events, the hit rate it expected (cached / prompt tokens of
  those decisions) beside the one the engines found, and event gaps and resyncs.

A counter that went down was reset (the replica restarted): the newest value is
then the delta, as Prometheus' `rate()` takes it. Counters of one process that are
divided (hits by queries) are reset together when either went down. A window with
no first token in it has no TTFT (None, shown as `-`), never 0; one with no
prefix-cache query has no hit rate.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dpserve.top.scrape import ReplicaSample, RoutingSample

WINDOW_S = 60.0

Buckets = tuple[tuple[float, float], ...]


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One refresh: what the router said, and when (monotonic seconds)."""

    at: float
    replicas: tuple[Mapping[str, Any], ...]
    """`GET /admin/replicas`' entries, in the router's order."""
    samples: Mapping[str, ReplicaSample]
    """Per replica id, from the metrics texts (`dpserve.top.scrape`)."""
    routing: RoutingSample | None = None
    """`kv-aware`'s decisions; None when the router runs another policy."""


@dataclass(frozen=True, slots=True)
class Row:
    """One replica's line in the view."""

    id: str
    state: str
    version: str
    adapters: tuple[str, ...]
    """Adapters it serves, as `NAME@VERSION`."""
    device: str
    in_flight: int
    """Requests the router has on it now."""
    waiting: float | None
    kv_cache_usage: float | None
    tokens_per_s: float | None
    """Generated tokens per second over the window."""
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    utilization: float | None
    """GPU utilization on a GPU replica, else CPU utilization (0 to 1)."""
    utilization_of: str
    """`gpu`, `cpu`, or empty when the router reports neither."""
    memory_used_bytes: float | None
    """GPU memory in use, or the process tree's RSS on a CPU replica."""
    memory_total_bytes: float | None
    """GPU memory installed; None on a CPU replica."""
    prefix_hit_rate: float | None = None
    """Prompt tokens the engine found in its prefix cache per token it looked up, over
    the window; None without a query in it."""
    kv_index_blocks: float | None = None
    """KV-cache blocks the router's index knows the replica holds (`kv-aware` only)."""
    kv_index_stale: bool | None = None
    """The index missed some of the replica's events: it scores no cached prefix."""
    kv_events_following: bool | None = None
    """False when the router does not follow the replica's events (the fallback routes
    it)."""


@dataclass(frozen=True, slots=True)
class KVSummary:
    """`kv-aware` over the window, the whole fleet; None where the window cannot say."""

    on_events: float | None
    """Share of the router's decisions made on KV events rather than by its fallback."""
    expected_hit_rate: float | None
    """Cached / prompt tokens of the decisions on events: the hit rate the router expects."""
    found_hit_rate: float | None
    """Prefix-cache hits / queries of all engines: the hit rate they found (every
    request, however it was placed)."""
    resyncs: float | None
    """Event gaps the replay could not fill, all replicas."""
    gaps: float | None
    """Times event batches arrived with numbers missing, all replicas."""


class History:
    """The scrapes of the last `window_s` seconds, oldest first."""

    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self._snapshots: deque[Snapshot] = deque()

    def add(self, snapshot: Snapshot) -> None:
        self._snapshots.append(snapshot)
        while self._snapshots[0].at < snapshot.at - self.window_s:
            self._snapshots.popleft()

    def __len__(self) -> int:
        return len(self._snapshots)

    @property
    def span_s(self) -> float:
        """Seconds between the oldest and the newest scrape kept."""
        return self._snapshots[-1].at - self._snapshots[0].at if self._snapshots else 0.0

    def rows(self) -> list[Row]:
        return rows(list(self._snapshots))

    def kv_summary(self) -> KVSummary | None:
        return kv_summary(list(self._snapshots))


def counter_deltas(new: Sequence[float], old: Sequence[float]) -> tuple[float, ...]:
    """Increases of counters one process keeps, between two scrapes. Judged together:
    if any went down the process restarted, and each is then everything since. One by
    one, a counter already past its old value after the restart would give a delta
    across it, and a ratio of two (hits / queries) could pass 100%."""
    if any(n < o for n, o in zip(new, old, strict=True)):
        return tuple(new)
    return tuple(n - o for n, o in zip(new, old, strict=True))


def bucket_deltas(new: Buckets, old: Buckets) -> Buckets:
    """Per-bucket increase of a cumulative histogram. A histogram whose total went down
    was reset: `new` is then the increase. Bounds missing from `old` count from 0."""
    if not old or (new and new[-1][1] < old[-1][1]):
        return new
    before = dict(old)
    return tuple((le, max(0.0, count - before.get(le, 0.0))) for le, count in new)


def histogram_quantile(q: float, buckets: Buckets) -> float | None:
    """The `q`-quantile (0 < q < 1) of a cumulative histogram, as Prometheus computes it:
    linear within the bucket the rank falls in, the lowest bucket starting at 0, and
    the highest finite bound when the rank falls in `+Inf`. None without observations
    or without a `+Inf` bucket."""
    if not buckets or not math.isinf(buckets[-1][0]):
        return None
    total = buckets[-1][1]
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for le, count in buckets:
        count = max(count, below)  # summed engines can leave a bucket a hair low
        if count >= rank:
            if math.isinf(le):
                return lower
            if count == below:
                return le
            return lower + (le - lower) * (rank - below) / (count - below)
        lower, below = le, count
    return lower


def _baseline(history: Sequence[Snapshot], replica: str, has: str) -> Snapshot | None:
    """The oldest snapshot before the newest one in which `replica` reported `has`."""
    for snap in history[:-1]:
        sample = snap.samples.get(replica)
        if sample is not None and getattr(sample, has) not in (None, ()):
            return snap
    return None


def _values(sample: ReplicaSample | None, attrs: Sequence[str]) -> tuple[float, ...] | None:
    if sample is None:
        return None
    values = tuple(getattr(sample, a) for a in attrs)
    return values if all(v is not None for v in values) else None


def _increase(history: Sequence[Snapshot], replica: str, attrs: Sequence[str]
              ) -> tuple[tuple[float, ...], float] | None:
    """How much `replica`'s counters `attrs` rose (reset together) and in how many
    seconds: from the oldest scrape in the window with them all to the newest. None
    without two such scrapes."""
    now = _values(history[-1].samples.get(replica), attrs) if history else None
    if now is None:
        return None
    for snap in history[:-1]:
        old = _values(snap.samples.get(replica), attrs)
        if old is not None:
            seconds = history[-1].at - snap.at
            return (counter_deltas(now, old), seconds) if seconds > 0 else None
    return None


def tokens_per_s(history: Sequence[Snapshot], replica: str) -> float | None:
    increase = _increase(history, replica, ("generation_tokens",))
    if increase is None:
        return None
    (tokens,), seconds = increase
    return tokens / seconds


HITS = ("prefix_cache_hits", "prefix_cache_queries")


def prefix_hit_rate(history: Sequence[Snapshot], replica: str) -> float | None:
    increase = _increase(history, replica, HITS)
    if increase is None:
        return None
    (hits, queries), _ = increase
    return hits / queries if queries > 0 else None


def ttft_quantiles(history: Sequence[Snapshot], replica: str,
                   qs: Sequence[float] = (0.5, 0.99)) -> tuple[float | None, ...]:
    """TTFT quantiles over the window; Nones until two scrapes have the histogram."""
    now = history[-1].samples.get(replica) if history else None
    base = _baseline(history, replica, "ttft_buckets")
    if now is None or not now.ttft_buckets or base is None:
        return tuple(None for _ in qs)
    deltas = bucket_deltas(now.ttft_buckets, base.samples[replica].ttft_buckets)
    return tuple(histogram_quantile(q, deltas) for q in qs)


def rows(history: Sequence[Snapshot]) -> list[Row]:
    """The view's rows for the newest snapshot, figures over the whole history."""
    if not history:
        return []
    latest = history[-1]
    out = []
    for r in latest.replicas:
        rid = str(r.get("id", "?"))
        s = latest.samples.get(rid, ReplicaSample())
        p50, p99 = ttft_quantiles(history, rid)
        gpu = s.gpu_utilization is not None or s.gpu_memory_used_bytes is not None
        cpu = s.cpu_utilization is not None or s.memory_rss_bytes is not None
        out.append(Row(
            id=rid, state=str(r.get("state", "?")),
            version=str(r.get("weight_version") or "unknown"),
            adapters=tuple(m for m in r.get("models", ()) if "@" in m),
            device=str(r.get("device", "")), in_flight=int(r.get("in_flight", 0)),
            waiting=s.waiting, kv_cache_usage=s.kv_cache_usage,
            tokens_per_s=tokens_per_s(history, rid), ttft_p50_s=p50, ttft_p99_s=p99,
            utilization=s.gpu_utilization if gpu else s.cpu_utilization,
            utilization_of="gpu" if gpu else "cpu" if cpu else "",
            memory_used_bytes=s.gpu_memory_used_bytes if gpu else s.memory_rss_bytes,
            memory_total_bytes=s.gpu_memory_total_bytes if gpu else None,
            prefix_hit_rate=prefix_hit_rate(history, rid),
            kv_index_blocks=s.kv_index_blocks, kv_index_stale=_flag(s.kv_index_stale),
            kv_events_following=_flag(s.kv_events_following),
        ))
    return out


def _flag(value: float | None) -> bool | None:
    return None if value is None else value > 0


def kv_summary(history: Sequence[Snapshot]) -> KVSummary | None:
    """`kv-aware`'s figures over the window; None when the newest scrape has none (the
    router runs another policy)."""
    latest = history[-1] if history else None
    if latest is None or latest.routing is None:
        return None
    oldest = next((s.routing for s in history[:-1]
                   if s.routing is not None and s.at < latest.at), None)
    on_events, expected = _decisions(latest.routing, oldest)
    found = _fleet_increase(history, HITS)
    resyncs = _fleet_increase(history, ("kv_event_resyncs",))
    gaps = _fleet_increase(history, ("kv_event_gaps",))
    return KVSummary(
        on_events=on_events,
        expected_hit_rate=expected,
        found_hit_rate=found[0] / found[1] if found is not None and found[1] > 0 else None,
        resyncs=None if resyncs is None else resyncs[0],
        gaps=None if gaps is None else gaps[0])


def _decisions(new: RoutingSample, old: RoutingSample | None
               ) -> tuple[float | None, float | None]:
    """Share of decisions on events, and cached / prompt tokens of those, between two
    scrapes of the router."""
    if old is None:
        return None, None
    # The router's counters reset together, when it restarts.
    restarted = any(value < before.get(key, 0.0)
                    for now, before in ((new.decisions, old.decisions),
                                        (new.routed_tokens, old.routed_tokens))
                    for key, value in now.items())
    decisions = _deltas(new.decisions, old.decisions, restarted)
    tokens = _deltas(new.routed_tokens, old.routed_tokens, restarted)
    decided = sum(decisions.values())
    prompt, cached = tokens.get("prompt"), tokens.get("cached")
    return (decisions.get("events", 0.0) / decided if decided > 0 else None,
            cached / prompt if prompt and cached is not None else None)


def _deltas(now: Mapping[str, float], before: Mapping[str, float], restarted: bool
            ) -> dict[str, float]:
    return {key: value if restarted else value - before.get(key, 0.0)
            for key, value in now.items()}


def _fleet_increase(history: Sequence[Snapshot], attrs: Sequence[str]
                    ) -> tuple[float, ...] | None:
    """Increases of counters `attrs` over the window, summed over the replicas that
    reported them twice; None when none did."""
    increases = [inc for rid in history[-1].samples
                 if (inc := _increase(history, rid, attrs)) is not None]
    if not increases:
        return None
    return tuple(sum(values) for values in zip(*(d for d, _ in increases), strict=True))
