"""One `/metrics` answer for a router that runs as several worker processes.

Each worker counts what it serves in its own registry (`RouterMetrics`). The
leader answers `/metrics` with its own exposition in which the data-plane
families (`SUMMED_FAMILIES`) are summed over every worker's, so a scrape reads
the router as one process with the label sets `RouterMetrics` declares; a
`worker` label instead would multiply every series by the worker count. The
other families (pool and breaker state, deploys, restarts, health checks) are
the leader's alone and pass through as it rendered them.

A counter's `_created` is the earliest worker's: the sum counts since the first
of them started. A follower that restarts brings its counts back to 0, so the
sum drops, and `rate()` reads that drop as a counter reset.

The texts are parsed and rendered again with prometheus_client, so the answer
escapes labels and help text exactly as a single registry's would.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field

from prometheus_client import generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

log = logging.getLogger("dpserve.router")

SUMMED_FAMILIES: frozenset[str] = frozenset({
    "dpserve_requests",
    "dpserve_request_duration_seconds",
    "dpserve_time_to_first_byte_seconds",
    "dpserve_event_loop_lag_seconds",
    "dpserve_request_retries",
    "dpserve_stream_errors",
    "dpserve_migrations",
    "dpserve_migration_refusals",
    "dpserve_client_disconnects",
    "dpserve_front_rejections",
    "dpserve_queue_depth",
    "dpserve_queue_wait_seconds",
    "dpserve_adapter_requests",
    "dpserve_trace_export_failures",
    "dpserve_kv_routing_decisions",
    "dpserve_kv_routed_tokens",
    "dpserve_kv_cached_prefix_tokens",
    "dpserve_kv_relayed_prompts",
})
"""The families every worker's data plane updates, by the names prometheus_client's
parser gives them (a counter's without `_total`). `kv-aware`'s index and feed series are
the leader's: every worker follows every replica's events itself, and so holds the
same index."""

_CREATED = "_created"
_HISTOGRAM_ORDER = {"_bucket": 0, "_count": 1, "_sum": 2}
"""Where a histogram's samples of one label set go: buckets, then count, then sum."""

_Key = tuple[str, tuple[tuple[str, str], ...]]


def merge_exposition(own: bytes, others: Sequence[bytes], summed: Collection[str]) -> bytes:
    """`own` (text format 0.0.4) with the families named in `summed` summed over `others`.

    Samples are matched by name and label set; one only a follower has is added, and
    so is a summed family only a follower has (after `own`'s families, whose order
    is kept). An empty text is a follower that has not reported yet. A text that does
    not parse, or declares a family with another type than the leader's, is left out
    whole with a warning: one broken worker must not take `/metrics` down. `own` is
    this process's rendering and must parse.
    """
    families: dict[str, _Family] = {}
    for metric in text_string_to_metric_families(own.decode()):
        families[metric.name] = _Family.of(metric)
    for i, text in enumerate(others):
        if not text:
            continue
        try:
            _fold(families, _summed_families(text, summed))
        except ValueError as exc:  # the parser's one error for malformed text, and ours
            log.warning("follower %d of %d: metrics left out of /metrics (%s)",
                        i + 1, len(others), exc)
    return generate_latest(_Families([f.metric() for f in families.values()]))


def _summed_families(text: bytes, summed: Collection[str]) -> list[_Family]:
    """The families of `text` to be summed, parsed whole before any is used."""
    return [_Family.of(m) for m in text_string_to_metric_families(text.decode())
            if _is_summed(m.name, summed)]


def _fold(families: dict[str, _Family], extra: list[_Family]) -> None:
    """Add `extra`'s samples into `families`, after checking that nothing conflicts."""
    for family in extra:
        mine = families.get(family.name)
        if mine is not None and mine.type != family.type:
            raise ValueError(f"{family.name} is a {family.type}, the leader's a {mine.type}")
    for family in extra:
        mine = families.setdefault(family.name, _Family(family.name, family.documentation,
                                                        family.type, family.unit))
        for sample in family.samples.values():
            mine.add(sample)


def _is_summed(name: str, summed: Collection[str]) -> bool:
    """Whether family `name` is summed: listed, or the `_created` gauge of one listed
    (the 0.0.4 format renders a counter's or histogram's `_created` as its own family)."""
    return name in summed or (name.endswith(_CREATED) and name[:-len(_CREATED)] in summed)


@dataclass
class _Family:
    """A metric family being merged: its samples by (sample name, sorted labels)."""

    name: str
    documentation: str
    type: str
    unit: str
    samples: dict[_Key, Sample] = field(default_factory=dict)

    @classmethod
    def of(cls, metric: Metric) -> _Family:
        family = cls(metric.name, metric.documentation, metric.type, metric.unit)
        for sample in metric.samples:
            family.add(sample)
        return family

    def add(self, sample: Sample) -> None:
        """Count `sample` in: summed with the sample of its key, or the earliest of the
        two for `_created`."""
        if self.type == "histogram" and sample.name.endswith("_bucket"):
            _bound(sample)  # checked here, where a follower's text may still be left out
        key = (sample.name, tuple(sorted(sample.labels.items())))
        seen = self.samples.get(key)
        if seen is None:
            self.samples[key] = sample
            return
        total = (min(seen.value, sample.value) if sample.name.endswith(_CREATED)
                 else seen.value + sample.value)
        self.samples[key] = Sample(seen.name, seen.labels, total, seen.timestamp,
                                   seen.exemplar, seen.native_histogram)

    def metric(self) -> Metric:
        metric = Metric(self.name, self.documentation, self.type, self.unit)
        samples = list(self.samples.values())
        if self.type == "histogram":  # a label set a follower added went last: regroup
            samples = self._histogram_order(samples)
        metric.samples = samples
        return metric

    def _histogram_order(self, samples: list[Sample]) -> list[Sample]:
        """Each label set's buckets by ascending `le` (+Inf last), then count and sum;
        label sets in the order they were first seen."""
        groups: dict[tuple[tuple[str, str], ...], int] = {}

        def position(sample: Sample) -> tuple[int, int, float]:
            group = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "le"))
            suffix = sample.name[len(self.name):]
            le = _bound(sample) if suffix == "_bucket" else 0.0
            return groups.setdefault(group, len(groups)), _HISTOGRAM_ORDER.get(suffix, 3), le

        return sorted(samples, key=position)


def _bound(bucket: Sample) -> float:
    """A histogram bucket's upper bound (`le`)."""
    le = bucket.labels.get("le")
    if le is None:
        raise ValueError(f"{bucket.name} has no le")
    return float(le)


class _Families(Collector):
    """Already merged families, in the shape `generate_latest` renders."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return self._families
