"""Two intervals a canary verdict rests on, both distribution-free or close to it, both
honest on few samples. Pure functions, no I/O.

- `shift`: how much slower one sample of latencies is than another, as a ratio, with
  a confidence interval: the Hodges-Lehmann estimate of the shift in log latency (the
  median of all pairwise differences) and the interval from inverting the
  Wilcoxon-Mann-Whitney rank-sum test. It assumes nothing about the shape of the
  distribution (latencies are heavy-tailed and multi-modal) and one slow outlier
  moves it by one pair in n*m, where a p90 moves with it. **Stratified**: pairs are
  formed only within a stratum (requests of similar size, sent in the same few
  seconds), so a burst or a long prompt that lands on one side more than the other is
  not taken for a difference between the sides; the test is van Elteren's sum of
  per-stratum rank sums, with its null variance.
- `rate_difference`: the difference of two error rates with Newcombe's hybrid score
  interval (method 10 of Newcombe 1998), built from two Wilson intervals: right
  coverage with 0 errors on either side, where the Wald interval collapses to a point.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

MAX_PAIRS = 1_000_000
"""Pairs compared at most (8 MB of float64; one partition of them, ~10 ms): beyond, the
interval's width is set by the subsample, and at a million pairs it is ~1% of the
ratio."""


@dataclass(frozen=True)
class Interval:
    estimate: float
    low: float
    high: float


def z_for(alpha: float) -> float:
    """The normal quantile for a two-sided interval missing with probability `alpha`."""
    return NormalDist().inv_cdf(1 - alpha / 2)


def shift(canary: Iterable[tuple[Hashable, float]], baseline: Iterable[tuple[Hashable, float]],
          z: float, *, seed: int = 0) -> Interval | None:
    """The ratio by which `canary`'s values exceed `baseline`'s, with a two-sided
    interval at normal quantile `z`; None when no stratum holds both sides. Each value
    is `(stratum, seconds)`, seconds > 0."""
    left: dict[Hashable, list[float]] = defaultdict(list)
    right: dict[Hashable, list[float]] = defaultdict(list)
    for key, value in canary:
        left[key].append(math.log(value))
    for key, value in baseline:
        right[key].append(math.log(value))
    shared = [k for k in left if k in right]
    pairs = sum(len(left[k]) * len(right[k]) for k in shared)
    if not pairs:
        return None
    # Beyond MAX_PAIRS, each side of each stratum keeps a random share of its values:
    # the test is then that of a random subsample (looser, never wrong).
    keep = min(1.0, math.sqrt(MAX_PAIRS / pairs))
    rng = np.random.default_rng(seed)
    diffs, mean, var = [], 0.0, 0.0
    for k in shared:
        x, y = np.asarray(left[k]), np.asarray(right[k])
        if keep < 1.0:
            x = rng.choice(x, size=max(1, math.ceil(len(x) * keep)), replace=False)
            y = rng.choice(y, size=max(1, math.ceil(len(y) * keep)), replace=False)
        diffs.append(np.subtract.outer(x, y).ravel())
        n, m = len(x), len(y)
        mean += n * m / 2  # the null moments of this stratum's Mann-Whitney U
        var += n * m * (n + m + 1) / 12
    d = np.concatenate(diffs)
    total = len(d)
    # The interval's ends are the k-th smallest and largest of the differences.
    k = math.floor(mean - z * math.sqrt(var))
    mid = total // 2  # the (upper) median: one partition finds it with both ends
    if k < 1:
        return Interval(math.exp(float(np.partition(d, mid)[mid])), 0.0, math.inf)
    lo, estimate, hi = np.partition(d, (k - 1, mid, total - k))[[k - 1, mid, total - k]]
    return Interval(math.exp(float(estimate)), math.exp(float(lo)), math.exp(float(hi)))


def wilson(errors: int, n: int, z: float) -> tuple[float, float]:
    """Wilson's score interval for a rate of `errors` in `n` (n > 0)."""
    p = errors / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def rate_difference(errors: int, n: int, base_errors: int, base_n: int,
                    z: float) -> Interval | None:
    """`errors/n - base_errors/base_n` with Newcombe's hybrid score interval at normal
    quantile `z`; None when either side has no request."""
    if n <= 0 or base_n <= 0:
        return None
    p, q = errors / n, base_errors / base_n
    l1, u1 = wilson(errors, n, z)
    l2, u2 = wilson(base_errors, base_n, z)
    low = p - q - math.sqrt((p - l1) ** 2 + (u2 - q) ** 2)
    high = p - q + math.sqrt((u1 - p) ** 2 + (q - l2) ** 2)
    return Interval(p - q, low, high)
