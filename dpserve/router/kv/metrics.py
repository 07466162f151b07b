"""`/metrics` for routing on KV events, read at scrape time: what the index holds of
each replica, how its event feed is doing, and what the policy decided.

Labels are replica ids and fixed words only: bounded by the fleet's size, and
nothing of any request's content.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from dpserve.router.kv.decisions import CACHED_BUCKETS, KVRoutingStats
from dpserve.router.kv.index import KVIndex


class KVCollector(Collector):
    """The KV-event series; `status` gives each replica's feed status
    (`KVEventFeeds.status`), `feed_stats` its subscriber's counters."""

    def __init__(self, index: KVIndex, status: Callable[[], Mapping[str, str]],
                 routing: KVRoutingStats, feed_stats: Callable[[], Mapping[str, Any]], *,
                 tokenizer_ready: Callable[[], bool] = lambda: True) -> None:
        self._index = index
        self._tokenizer_ready = tokenizer_ready
        self._status = status
        self._routing = routing
        self._feed_stats = feed_stats

    def collect(self) -> Iterable[Metric]:
        yield from self._index_series()
        yield from self._feed_series()
        yield from self._routing_series()

    def _index_series(self) -> Iterable[Metric]:
        blocks = GaugeMetricFamily("dpserve_kv_index_blocks",
                                   "KV-cache blocks the router knows each replica holds.",
                                   labels=["replica"])
        stale = GaugeMetricFamily("dpserve_kv_index_stale",
                                  "1 while a replica missed event batches: it scores no "
                                  "cached prefix until replayed or cleared.",
                                  labels=["replica"])
        gaps = CounterMetricFamily("dpserve_kv_event_gaps",
                                   "Times a replica's event batches arrived with numbers "
                                   "missing.", labels=["replica"])
        known = {str(rid): st for rid, st in self._index.stats().items()}
        # Every followed replica from the start, at 0 until its first batch: a series
        # that appears only at its first event is invisible to rate() at that event.
        following = {rid for rid, status in self._status().items() if status == "following"}
        for rid in sorted(set(known) | following):
            st = known.get(rid)
            blocks.add_metric([rid], st.blocks if st is not None else 0)
            stale.add_metric([rid], 1.0 if st is not None and st.stale else 0.0)
            gaps.add_metric([rid], st.gaps if st is not None else 0)
        return [blocks, stale, gaps]

    def _feed_series(self) -> Iterable[Metric]:
        following = GaugeMetricFamily("dpserve_kv_events_following",
                                      "1 for a replica whose KV events the router follows, "
                                      "0 for one routed by the fallback policy.",
                                      labels=["replica"])
        for rid, status in sorted(self._status().items()):
            following.add_metric([rid], 1.0 if status == "following" else 0.0)
        yield following
        stats = self._feed_stats()
        counters = {
            "batches": ("dpserve_kv_event_batches", "Event batches applied."),
            "replays": ("dpserve_kv_event_replays",
                        "Missed batches fetched from the replica's replay socket."),
            "resyncs": ("dpserve_kv_event_resyncs",
                        "Gaps the replay could not fill: the replica was unscored until "
                        "its cache reset."),
            "malformed": ("dpserve_kv_event_malformed",
                          "Event messages that could not be decoded, skipped."),
        }
        for attr, (name, doc) in counters.items():
            family = CounterMetricFamily(name, doc, labels=["replica"])
            for rid, st in sorted(stats.items()):
                value = getattr(st, attr, None)
                if value is not None:
                    family.add_metric([rid], float(value))
            yield family
        lag = GaugeMetricFamily("dpserve_kv_event_lag_seconds",
                                "Seconds since the replica's last event batch arrived.",
                                labels=["replica"])
        for rid, st in sorted(stats.items()):
            value = getattr(st, "lag_s", None)
            if value is not None:
                lag.add_metric([rid], float(value))
        yield lag

    def _routing_series(self) -> Iterable[Metric]:
        r = self._routing
        ready = GaugeMetricFamily(
            "dpserve_kv_tokenizer_ready",
            "1 once the prompt tokenizer is loaded; 0 while it loads (in the background, "
            "seconds) or when it could not be: requests are then placed by the fallback "
            "policy, counted as no_tokens.")
        ready.add_metric([], 1.0 if self._tokenizer_ready() else 0.0)
        decisions = CounterMetricFamily(
            "dpserve_kv_routing_decisions",
            "Requests placed by `kv-aware`: on the engines' KV events, or by the fallback "
            "policy and why (no_tokens: the prompt's token ids are not known exactly; "
            "no_events: no candidate's events are known).", labels=["basis"])
        decisions.add_metric(["events"], r.on_events)
        for reason, n in sorted((r.fallbacks or {}).items()):
            decisions.add_metric([reason], n)
        tokens = CounterMetricFamily(
            "dpserve_kv_routed_tokens",
            "Prompt tokens of the requests placed on events, and of those the tokens the "
            "chosen replica held (their ratio: the hit rate the router expects).",
            labels=["kind"])
        tokens.add_metric(["prompt"], r.prompt_tokens)
        tokens.add_metric(["cached"], r.cached_tokens)
        counts = r.cached_histogram or [0] * (len(CACHED_BUCKETS) + 1)
        buckets, total = [], 0
        for bound, n in zip([*map(str, CACHED_BUCKETS), "+Inf"], counts, strict=True):
            total += n
            buckets.append((bound if bound == "+Inf" else f"{float(bound):g}", total))
        histogram = HistogramMetricFamily(
            "dpserve_kv_cached_prefix_tokens",
            "Per request placed on events: the chosen replica's cached-prefix length.",
            buckets=buckets, sum_value=r.cached_tokens)
        relayed = CounterMetricFamily(
            "dpserve_kv_relayed_prompts",
            "Prompts placed by another data-plane worker of this router (or, on the "
            "workers after the first, by a peer router) and counted as held where they "
            "went until that engine reports them, summed over the workers.")
        relayed.add_metric([], r.relayed_prompts)
        return [ready, decisions, tokens, histogram, relayed]
