"""Rates and percentiles over the last minute, from successive scrapes.

A scrape holds counters (tokens generated since the engine started) and a
cumulative histogram (every first token the engine ever timed). What a person
watching wants is the last minute, so :class:`History` keeps the scrapes of the
last `WINDOW_S` seconds, and each figure is the difference between the newest
scrape and the oldest one in the window that has that replica's series:

- tokens/s: counter delta / time between the two scrapes;
- TTFT p50/p99: the quantile of the histogram's bucket deltas, interpolated
  within a bucket as Prometheus' `histogram_quantile` does;
- prefix hit: the engine's prefix-cache hits delta / queries delta (tokens).

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

from dpserve.top.scrape import ReplicaSample

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
        ))
    return out

