"""What a simulated replica counts (its page is rendered by `dpserve.sim.exposition`).

The page carries the series routers and dashboards read from a real vLLM
(0.32): the scheduler gauges, KV-cache usage, prefix-cache queries and hits in
tokens, token and request counters and the latency histograms, labelled
``model_name`` and ``engine`` as vLLM labels them. One series is the
simulator's own, `dpserve_sim_step_timing_error_seconds`: how far the event
loop missed each step's deadline, the check that the simulation is not
distorted by the machine running it.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM 0.32's buckets (vllm/v1/metrics/buckets.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TIMING_ERROR_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1)


class Histogram:
    """Counts per bucket (made cumulative when rendered) and the largest value seen."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        self.count = 0
        self.max = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1
        self.max = max(self.max, value)

    def fraction_above(self, bound: float) -> float:
        """Share of observations above `bound`, which must be one of the bounds."""
        i = self.bounds.index(bound)
        return sum(self.counts[i + 1:]) / self.count if self.count else 0.0

    def buckets(self) -> list[tuple[str, float]]:
        out, running = [], 0
        for bound, n in zip(self.bounds, self.counts, strict=False):
            running += n
            out.append((repr(float(bound)), float(running)))
        out.append(("+Inf", float(self.count)))
        return out


@dataclass
class EngineStats:
    """Monotonic counters of one engine, from its start."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_cache_queries: int = 0
    """Prompt tokens looked up in the prefix cache (once per admission)."""
    prefix_cache_hits: int = 0
    """Of those, tokens found cached."""
    preemptions: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    steps: int = 0
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
    timing_error: Histogram = field(default_factory=lambda: Histogram(TIMING_ERROR_BUCKETS))
    """How far each step's end missed its modelled deadline, early or late."""
