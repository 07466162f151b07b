"""From request records to the numbers of a run: pure functions, no I/O.

Definitions (vLLM's benchmark's, `vllm.benchmarks.serve.calculate_metrics`):

- TTFT, ITL and E2E latency per request: see `loadtest.client`.
- ``TPOT = (E2E - TTFT) / (output_tokens - 1)`` for a request with more than
  one output token (others have no TPOT).
- Each latency is summarized over the successful requests as mean, median,
  standard deviation (population, ``numpy.std``) and percentiles (numpy's
  default linear interpolation), in milliseconds. ITL pools the gaps of all
  requests.
- ``request_throughput = completed / duration``; ``output_throughput =
  output tokens / duration``; ``total_token_throughput = (prompt + output
  tokens) / duration``, where ``duration`` runs from the start of the run to
  the end of its last request, and tokens are those of successful requests.
- Goodput (DistServe): successful requests that meet every given SLO
  (``ttft <= SLO``, ``tpot <= SLO``, ``e2el <= SLO``; a request with one output
  token counts as TPOT 0), per second of ``duration``.
- Peak concurrency: the most requests in flight at one instant, from the
  send and end times of every request sent (failed ones too).
- Queue time: how long a request waited past its scheduled send time for a
  concurrency slot (or for the client to get to it).
- Gaps read together: the share of ITL gaps that are 0 because the event came in
  the same socket read as the one before. vLLM's client times events the same way;
  past half, the median ITL is 0: the stream arrived in bursts (an API server or a
  client short of CPU), and TPOT is the per-token figure to read.
- Sending span: from the start of the run to the last request sent; the rest of
  ``duration`` is the drain. A short run at a rate above what the fleet serves is
  mostly ramp and drain, and its throughput says little of a steady state.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from loadtest.client import RequestRecord

SLO_METRICS = ("ttft", "tpot", "e2el")


@dataclass(frozen=True, kw_only=True)
class Distribution:
    """Summary of one latency, in milliseconds; all None when nothing was measured."""

    count: int
    mean: float | None
    median: float | None
    std: float | None
    percentiles: dict[str, float | None]
    """Keyed ``"p90"``, ``"p99"``, ``"p99.9"``: see `percentile_key`."""


@dataclass(frozen=True, kw_only=True)
class ReplicaMetrics:
    """The requests one replica answered (named by the router's response header)."""

    requests: int
    completed: int
    failed: int
    share: float
    """This replica's fraction of all completed requests."""
    output_tokens: int
    request_throughput: float
    ttft_ms: Distribution
    tpot_ms: Distribution
    e2el_ms: Distribution


@dataclass(frozen=True, kw_only=True)
class Metrics:
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    request_goodput: float | None
    """None when no SLO was given."""
    good_requests: int | None
    peak_concurrency: int
    ttft_ms: Distribution
    tpot_ms: Distribution
    itl_ms: Distribution
    e2el_ms: Distribution
    queue_ms: Distribution
    itl_read_together: float | None = None
    """The share of ITL gaps that are 0: events read with the one before (None: no gap)."""
    sending_s: float = 0.0
    """From the start of the run to the last request sent."""
    failures: dict[str, int] = field(default_factory=dict)
    """Failed requests by reason, most frequent first."""
    per_replica: dict[str, ReplicaMetrics] = field(default_factory=dict)


def percentile_key(p: float) -> str:
    """``99 -> "p99"``, ``99.9 -> "p99.9"``."""
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"


def distribution(values_s: Sequence[float], percentiles: Sequence[float]) -> Distribution:
    """Summary of ``values_s`` (seconds) in milliseconds."""
    if not values_s:
        return Distribution(count=0, mean=None, median=None, std=None,
                            percentiles={percentile_key(p): None for p in percentiles})
    ms = np.asarray(values_s, dtype=float) * 1000.0
    return Distribution(
        count=len(ms), mean=float(np.mean(ms)), median=float(np.median(ms)),
        std=float(np.std(ms)),
        percentiles={percentile_key(p): float(np.percentile(ms, p)) for p in percentiles})


def tpot_s(record: RequestRecord) -> float | None:
    """(E2E - TTFT) / (output tokens - 1), for a successful request with 2+ tokens."""
    if not record.ok or record.output_tokens < 2 or record.ttft_s is None \
            or record.latency_s is None:
        return None
    return (record.latency_s - record.ttft_s) / (record.output_tokens - 1)


def meets_slos(record: RequestRecord, slos_ms: Mapping[str, float]) -> bool:
    """True if a successful request is within every SLO (milliseconds)."""
    if not record.ok:
        return False
    measured = {"ttft": record.ttft_s, "tpot": tpot_s(record) or 0.0, "e2el": record.latency_s}
    for name, limit_ms in slos_ms.items():
        value = measured[name]
        if value is None or value * 1000.0 > limit_ms:
            return False
    return True


def peak_concurrency(intervals: Iterable[tuple[float, float]]) -> int:
    """Most intervals ``(start, end)`` open at one instant; one ending as another
    starts does not overlap it."""
    spans = list(intervals)
    events = sorted([(end, -1) for _, end in spans] + [(start, 1) for start, _ in spans])
    peak = current = 0
    for _, step in events:
        current += step
        peak = max(peak, current)
    return peak


def summarize(
    records: Sequence[RequestRecord],
    duration_s: float,
    *,
    percentiles: Sequence[float] = (90, 95, 99),
    slos_ms: Mapping[str, float] | None = None,
) -> Metrics:
    ok = [r for r in records if r.ok]
    total_input = sum(r.prompt_tokens for r in ok)
    total_output = sum(r.output_tokens for r in ok)
    good = sum(meets_slos(r, slos_ms) for r in ok) if slos_ms else None
    per_second = 1.0 / duration_s if duration_s > 0 else 0.0
    return Metrics(
        completed=len(ok),
        failed=len(records) - len(ok),
        duration_s=duration_s,
        total_input_tokens=total_input,
        total_output_tokens=total_output,
        request_throughput=len(ok) * per_second,
        output_throughput=total_output * per_second,
        total_token_throughput=(total_input + total_output) * per_second,
        request_goodput=None if good is None else good * per_second,
        good_requests=good,
        peak_concurrency=peak_concurrency((r.start_s, r.end_s) for r in records),
        **_latencies(ok, percentiles),
        itl_ms=distribution(gaps := [gap for r in ok for gap in r.itl_s], percentiles),
        itl_read_together=sum(gap == 0.0 for gap in gaps) / len(gaps) if gaps else None,
        sending_s=max((r.start_s for r in records), default=0.0),
        queue_ms=distribution([r.start_s - r.scheduled_s for r in ok], percentiles),
        failures=dict(Counter(r.error or "unknown" for r in records if not r.ok).most_common()),
        per_replica=_per_replica(records, len(ok), duration_s, percentiles),
    )


def _latencies(ok: Sequence[RequestRecord], percentiles: Sequence[float]
               ) -> dict[str, Distribution]:
    tpots = [t for r in ok if (t := tpot_s(r)) is not None]
    return {
        "ttft_ms": distribution([r.ttft_s for r in ok if r.ttft_s is not None], percentiles),
        "tpot_ms": distribution(tpots, percentiles),
        "e2el_ms": distribution([r.latency_s for r in ok if r.latency_s is not None],
                                percentiles),
    }


def _per_replica(records: Sequence[RequestRecord], completed: int, duration_s: float,
                 percentiles: Sequence[float]) -> dict[str, ReplicaMetrics]:
    by_replica: dict[str, list[RequestRecord]] = {}
    for r in records:
        if r.replica is not None:
            by_replica.setdefault(r.replica, []).append(r)
    out = {}
    for replica in sorted(by_replica):
        mine = by_replica[replica]
        ok = [r for r in mine if r.ok]
        out[replica] = ReplicaMetrics(
            requests=len(mine), completed=len(ok), failed=len(mine) - len(ok),
            share=len(ok) / completed if completed else 0.0,
            output_tokens=sum(r.output_tokens for r in ok),
            request_throughput=len(ok) / duration_s if duration_s > 0 else 0.0,
            **_latencies(ok, percentiles))
    return out
