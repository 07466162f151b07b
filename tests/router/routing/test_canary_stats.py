"""The two intervals a canary verdict rests on: the stratified rank shift of latencies and
Newcombe's difference of error rates, against published values and their definitions."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpserve.router.routing.canary_stats import rate_difference, shift, wilson, z_for

Z95 = z_for(0.05)


@pytest.mark.parametrize(("k", "n", "low", "high"), [
    (0, 10, 0.0, 0.2775), (81, 263, 0.2553, 0.3662), (1, 29, 0.0061, 0.1718)])
def test_wilson_matches_newcombes_published_intervals(k, n, low, high):
    got = wilson(k, n, Z95)
    assert got == pytest.approx((low, high), abs=1e-3)


@pytest.mark.parametrize(("a", "n", "b", "m", "low", "high"), [
    (56, 70, 48, 80, 0.0524, 0.3339),  # Newcombe 1998, table II, method 10
    (9, 10, 3, 10, 0.1705, 0.8090),
    (5, 56, 0, 29, -0.0381, 0.1926),
])
def test_the_rate_difference_matches_newcombes_method_10(a, n, b, m, low, high):
    got = rate_difference(a, n, b, m, Z95)
    assert got is not None
    assert (got.low, got.high) == pytest.approx((low, high), abs=1e-3)


def test_no_errors_on_either_side_bounds_the_difference_by_the_sample_size():
    """What a healthy canary faces: 0 of n against 0 of n is 'within 2 points' only once
    n is large enough (z^2 / n)."""
    small, large = rate_difference(0, 100, 0, 100, 2.5), rate_difference(0, 400, 0, 400, 2.5)
    assert small is not None and large is not None
    assert small.estimate == 0 and small.high > 0.05
    assert large.high < 0.02 and large.low == -large.high


def test_a_side_without_requests_has_no_interval():
    assert rate_difference(0, 0, 0, 10, Z95) is None
    assert shift([(0, 0.1)], [(1, 0.1)], Z95) is None  # no stratum holds both


def u_statistic(canary, baseline, delta):
    """Van Elteren's sum of per-stratum Mann-Whitney counts at shift `delta` (logs)."""
    return sum(math.log(x) - delta > math.log(y)
               for kx, x in canary for ky, y in baseline if kx == ky)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.floats(1e-3, 10)), min_size=3, max_size=25),
       st.lists(st.tuples(st.integers(0, 2), st.floats(1e-3, 10)), min_size=3, max_size=25))
def test_the_shift_interval_is_the_rank_tests_acceptance_region(canary, baseline):
    """Inside the interval the stratified rank sum is within z sigma of its null mean;
    just outside either end it is not (the interval inverts the test)."""
    iv = shift(canary, baseline, Z95)
    if iv is None:
        return
    pairs, var = 0, 0.0
    for k in {k for k, _ in canary}:
        n = sum(kx == k for kx, _ in canary)
        m = sum(ky == k for ky, _ in baseline)
        pairs += n * m
        var += n * m * (n + m + 1) / 12
    assert iv.low <= iv.estimate <= iv.high
    if iv.low == 0.0:  # too few pairs for any bound at this confidence
        return
    lo, hi = math.log(iv.low), math.log(iv.high)
    assert u_statistic(canary, baseline, lo - 1e-9) >= pairs / 2 - Z95 * math.sqrt(var) - 1
    assert u_statistic(canary, baseline, hi + 1e-9) <= pairs / 2 + Z95 * math.sqrt(var) + 1
    assert u_statistic(canary, baseline, lo - 1e-9) - u_statistic(
        canary, baseline, hi + 1e-9) >= 1  # a region, not a point


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1), st.floats(1e-3, 10)), min_size=5, max_size=30),
       st.lists(st.tuples(st.integers(0, 1), st.floats(1e-3, 10)), min_size=5, max_size=30),
       st.floats(0.01, 100))
def test_the_ratio_does_not_depend_on_the_unit_and_swapping_sides_inverts_it(
        canary, baseline, scale):
    iv = shift(canary, baseline, Z95)
    if iv is None or iv.low == 0.0:
        return
    scaled = shift([(k, v * scale) for k, v in canary], [(k, v * scale) for k, v in baseline],
                   Z95)
    swapped = shift(baseline, canary, Z95)
    assert scaled is not None and swapped is not None
    assert scaled.estimate == pytest.approx(iv.estimate, rel=1e-6)
    assert (scaled.low, scaled.high) == pytest.approx((iv.low, iv.high), rel=1e-6)
    assert (swapped.low, swapped.high) == pytest.approx((1 / iv.high, 1 / iv.low), rel=1e-6)


def test_a_burst_on_one_side_is_not_taken_for_a_slower_replica():
    """The canary's requests fell mostly in a burst (everything 5x slower for a while);
    within each time block the two sides are as fast. Unstratified, the canary looks
    ~2x slower; stratified, as fast."""
    rng = random.Random(0)

    def sample(stratum, slow, n):
        return [(stratum, math.exp(rng.gauss(0, 0.3)) * (0.5 if slow else 0.1))
                for _ in range(n)]

    canary = sample(0, False, 40) + sample(1, True, 160)
    baseline = sample(0, False, 160) + sample(1, True, 40)
    pooled = shift([(0, v) for _, v in canary], [(0, v) for _, v in baseline], Z95)
    stratified = shift(canary, baseline, Z95)
    assert pooled is not None and pooled.low > 1.5
    assert stratified is not None and stratified.low < 1 < stratified.high


def test_the_interval_covers_a_true_2x_slowdown_as_often_as_it_says():
    """100 windows of 60 heavy-tailed answers a side, the canary 2x slower in truth: the
    95% interval holds 2 in about 95 of them (binomial: 88 or more with 99% odds)."""
    rng = random.Random(1)
    covered, estimates = 0, []
    for _ in range(100):
        canary = [(i % 3, 2 * math.exp(rng.gauss(0, 0.8))) for i in range(60)]
        baseline = [(i % 3, math.exp(rng.gauss(0, 0.8))) for i in range(60)]
        iv = shift(canary, baseline, Z95)
        assert iv is not None
        covered += iv.low <= 2 <= iv.high
        estimates.append(iv.estimate)
    assert covered >= 88
    assert 1.8 < sorted(estimates)[50] < 2.2


def test_beyond_the_pairs_it_compares_a_random_share_still_finds_the_shift(monkeypatch):
    """A window at a high rate: each side of a stratum subsampled so that the pairs fit
    (memory bounded), the estimate and the interval still hold the true ratio."""
    import dpserve.router.routing.canary_stats as stats

    monkeypatch.setattr(stats, "MAX_PAIRS", 10_000)
    rng = random.Random(2)
    canary = [(0, 1.5 * math.exp(rng.gauss(0, 0.5))) for _ in range(3000)]
    baseline = [(0, math.exp(rng.gauss(0, 0.5))) for _ in range(3000)]
    iv = shift(canary, baseline, Z95)
    assert iv is not None and iv.low < 1.5 < iv.high and iv.high / iv.low < 1.4
