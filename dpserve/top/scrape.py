"""One scrape of the router's metrics, as one :class:`ReplicaSample` per replica.

Two texts feed it: the router's own `/metrics` (the device collectors of
`dpserve.metrics`: `dpserve_gpu_*` on GPU replicas, `dpserve_replica_cpu_*` and
`_memory_rss_bytes` on CPU ones, each labelled `replica`) and `/metrics/engines`
(every replica's vLLM metrics, labelled `replica` by `dpserve.router.telemetry.federate`).
When the router routes `kv-aware`, its `/metrics` also has the series of
`dpserve.router.kv.metrics`: per replica what its KV index holds and how its event
feed does (into the :class:`ReplicaSample`), and fleet-wide what the policy decided
(a :class:`RoutingSample`, from :func:`parse_routing`).

vLLM labels its series `model_name` and `engine` (several engines when one server
runs data-parallel internally): counts, counters and histogram buckets are summed
over those, KV-cache usage takes the fullest engine, as `dpserve.router.fleet.engine_metrics`
does for routing. A series that is absent stays None, never a guessed 0: a replica
that has not reported must not look idle.

The text is parsed by prometheus_client's parser (a dependency already, kept with
the format); it refuses a whole text over one malformed line, so a text that does
not parse is a :class:`ScrapeError` and the view says which one failed.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from dpserve.router.fleet.engine_metrics import (
    KV_CACHE_USAGE,
    PREFIX_CACHE_HITS,
    PREFIX_CACHE_QUERIES,
    RUNNING,
    WAITING,
)

LABEL = "replica"
"""The label `dpserve.router.telemetry.federate` adds to engine samples and the device collectors
put on theirs (not imported from federate: that would load the router's web stack)."""

GENERATION_TOKENS = "vllm:generation_tokens_total"
TTFT_BUCKET = "vllm:time_to_first_token_seconds_bucket"
GPU_UTILIZATION = "dpserve_gpu_utilization_ratio"
GPU_MEMORY_USED = "dpserve_gpu_memory_used_bytes"
GPU_MEMORY_TOTAL = "dpserve_gpu_memory_total_bytes"
CPU_UTILIZATION = "dpserve_replica_cpu_utilization_ratio"
MEMORY_RSS = "dpserve_replica_memory_rss_bytes"
KV_INDEX_BLOCKS = "dpserve_kv_index_blocks"
KV_INDEX_STALE = "dpserve_kv_index_stale"
KV_EVENTS_FOLLOWING = "dpserve_kv_events_following"
KV_EVENT_GAPS = "dpserve_kv_event_gaps_total"
KV_EVENT_RESYNCS = "dpserve_kv_event_resyncs_total"
KV_DECISIONS = "dpserve_kv_routing_decisions_total"
KV_ROUTED_TOKENS = "dpserve_kv_routed_tokens_total"

_SUMMED = {RUNNING: "running", WAITING: "waiting", GENERATION_TOKENS: "generation_tokens",
           PREFIX_CACHE_HITS + "_total": "prefix_cache_hits",
           PREFIX_CACHE_QUERIES + "_total": "prefix_cache_queries",
           GPU_MEMORY_USED: "gpu_memory_used_bytes",
           GPU_MEMORY_TOTAL: "gpu_memory_total_bytes",
           CPU_UTILIZATION: "cpu_utilization", MEMORY_RSS: "memory_rss_bytes",
           # The router's, one sample per replica: the sum is that sample.
           KV_INDEX_BLOCKS: "kv_index_blocks", KV_INDEX_STALE: "kv_index_stale",
           KV_EVENTS_FOLLOWING: "kv_events_following", KV_EVENT_GAPS: "kv_event_gaps",
           KV_EVENT_RESYNCS: "kv_event_resyncs"}


class ScrapeError(ValueError):
    """A metrics text that does not parse; the message says where."""


@dataclass(frozen=True, slots=True)
class ReplicaSample:
    """What one scrape says about one replica; None where nothing was reported."""

    running: float | None = None
    """Requests in the engine's running batch."""
    waiting: float | None = None
    """Requests the engine holds but cannot schedule yet."""
    kv_cache_usage: float | None = None
    """KV-cache usage, 0 to 1 (the fullest engine of the server)."""
    generation_tokens: float | None = None
    """Tokens generated since the engine started (a counter)."""
    ttft_buckets: tuple[tuple[float, float], ...] = ()
    """The engine's time-to-first-token histogram: (upper bound in seconds, cumulative
    count) by rising bound, `+Inf` last; empty when not reported."""
    gpu_utilization: float | None = None
    """Mean utilization (0 to 1) of the GPUs the replica runs on."""
    gpu_memory_used_bytes: float | None = None
    gpu_memory_total_bytes: float | None = None
    cpu_utilization: float | None = None
    """CPU time per wall time per core the replica is bound to (CPU replicas)."""
    memory_rss_bytes: float | None = None
    """Resident memory of the replica's process tree (CPU replicas)."""
    prefix_cache_hits: float | None = None
    """Prompt tokens the engine found in its prefix cache since it started (a counter)."""
    prefix_cache_queries: float | None = None
    """Prompt tokens the engine looked up in its prefix cache (a counter)."""
    kv_index_blocks: float | None = None
    """KV-cache blocks the router's index knows the replica holds (`kv-aware`)."""
    kv_index_stale: float | None = None
    """1 while the replica missed event batches and scores no cached prefix, else 0."""
    kv_events_following: float | None = None
    """1 when the router follows the replica's KV events, 0 when the fallback routes it."""
    kv_event_gaps: float | None = None
    """Times its event batches arrived with numbers missing (a counter)."""
    kv_event_resyncs: float | None = None
    """Gaps the replay could not fill (a counter)."""


@dataclass(frozen=True, slots=True)
class RoutingSample:
    """What `kv-aware` decided since the router started (its counters): present only
    when the router runs that policy."""

    decisions: Mapping[str, float]
    """Requests placed, by basis: `events`, or a fallback's reason (`no_tokens`,
    `no_events`). The router exports every basis from its start."""
    routed_tokens: Mapping[str, float]
    """Tokens of the requests placed on events, by kind: `prompt`, and of those `cached`
    (the chosen replica held them: their ratio is the hit rate the router expects)."""


@dataclass
class _Acc:
    sums: dict[str, float] = field(default_factory=dict)
    kv: float | None = None
    buckets: dict[float, float] = field(default_factory=dict)
    gpu_util: list[float] = field(default_factory=list)

    def sample(self) -> ReplicaSample:
        return ReplicaSample(
            kv_cache_usage=self.kv,
            ttft_buckets=tuple(sorted(self.buckets.items())),
            gpu_utilization=(sum(self.gpu_util) / len(self.gpu_util)
                             if self.gpu_util else None),
            **{attr: self.sums[attr] for attr in _SUMMED.values() if attr in self.sums},
        )


def samples(text: str, source: str) -> Iterator[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample in a Prometheus text; ScrapeError naming
    `source` if it does not parse."""
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                yield s.name, s.labels, s.value
    except ValueError as exc:
        raise ScrapeError(f"{source} does not parse: {exc}") from None


def parse_replicas(router_text: str | None, engines_text: str | None
                   ) -> dict[str, ReplicaSample]:
    """Per-replica samples from the router's `/metrics` and `/metrics/engines` texts
    (None: that text is missing). Samples without a `replica` label are left out, as
    is a GPU no replica uses (`replica="none"`)."""
    acc: dict[str, _Acc] = {}
    for text, source in ((router_text, "/metrics"), (engines_text, "/metrics/engines")):
        if text is None:
            continue
        for name, labels, value in samples(text, source):
            replica = labels.get(LABEL)
            if replica is None or replica == "none" or math.isnan(value):
                continue
            _add(acc.setdefault(replica, _Acc()), name, labels, value)
    return {replica: a.sample() for replica, a in acc.items()}


def parse_routing(router_text: str | None) -> RoutingSample | None:
    """`kv-aware`'s decisions from the router's `/metrics`; None when the text is missing
    or the router does not route on KV events (it has no decision counter)."""
    if router_text is None:
        return None
    decisions: dict[str, float] = {}
    tokens: dict[str, float] = {}
    for name, labels, value in samples(router_text, "/metrics"):
        if math.isnan(value):
            continue
        if name == KV_DECISIONS and "basis" in labels:
            decisions[labels["basis"]] = value
        elif name == KV_ROUTED_TOKENS and "kind" in labels:
            tokens[labels["kind"]] = value
    if not decisions:
        return None
    return RoutingSample(decisions, tokens)


def _add(a: _Acc, name: str, labels: dict[str, str], value: float) -> None:
    if name in _SUMMED:
        attr = _SUMMED[name]
        a.sums[attr] = a.sums.get(attr, 0.0) + value
    elif name == KV_CACHE_USAGE:
        a.kv = value if a.kv is None else max(a.kv, value)
    elif name == TTFT_BUCKET:
        try:
            le = float(labels["le"])
        except (KeyError, ValueError):
            return
        a.buckets[le] = a.buckets.get(le, 0.0) + value
    elif name == GPU_UTILIZATION:
        a.gpu_util.append(value)

