"""When each request is sent: pure functions from settings to send offsets.

The schedule follows vLLM's benchmark (`vllm.benchmarks.serve.get_request`):

- request ``i`` waits a gap drawn from a gamma distribution with shape
  ``burstiness`` and scale ``1 / (rate_i * burstiness)`` (mean ``1 / rate_i``)
  after request ``i - 1``; the first request waits one gap too. Burstiness 1 is
  a Poisson process, below 1 burstier, above 1 more regular, infinite exactly
  periodic;
- an infinite rate sends everything at offset 0 (the concurrency cap, if any,
  then makes it a closed loop);
- at a fixed rate the offsets are rescaled so the last one is exactly
  ``n / rate``: the offered load then does not wander by a percent or two
  from seed to seed;
- a ramp-up moves ``rate_i`` from a start to an end rate over the requests,
  linearly or exponentially in the request index (no rescaling).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

RampStrategy = Literal["linear", "exponential"]


@dataclass(frozen=True, kw_only=True)
class RampUp:
    """The offered rate moves from ``start_rps`` (first request) to ``end_rps`` (last)."""

    strategy: RampStrategy
    start_rps: float
    end_rps: float


def rate_at(index: int, total: int, request_rate: float, ramp_up: RampUp | None) -> float:
    """The offered rate (requests/s) at which request ``index`` of ``total`` arrives."""
    if ramp_up is None:
        return request_rate
    progress = index / max(total - 1, 1)
    if ramp_up.strategy == "linear":
        return ramp_up.start_rps + (ramp_up.end_rps - ramp_up.start_rps) * progress
    return float(ramp_up.start_rps * (ramp_up.end_rps / ramp_up.start_rps) ** progress)


def arrival_offsets(
    n: int,
    *,
    request_rate: float,
    burstiness: float = 1.0,
    ramp_up: RampUp | None = None,
    seed: int = 0,
) -> list[float]:
    """Send offsets in seconds from the start of the run, non-decreasing, one per request."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if n == 0:
        return []
    if ramp_up is None and math.isinf(request_rate):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    gaps: list[float] = []
    for i in range(n):
        rate = rate_at(i, n, request_rate, ramp_up)
        if not rate > 0:
            raise ValueError(f"the request rate must be > 0, got {rate} for request {i}")
        if math.isinf(rate):
            gaps.append(0.0)
        elif math.isinf(burstiness):
            gaps.append(1.0 / rate)
        else:
            gaps.append(float(rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness))))
    offsets = np.cumsum(gaps)
    if ramp_up is None and offsets[-1] > 0:
        offsets *= (n / request_rate) / offsets[-1]
    return [float(t) for t in offsets]
