"""The canary verdict: worse, not worse or unsure, and wrong no more often than its stated
confidence allows, on simulated windows of heavy-tailed latencies."""

from __future__ import annotations

import math
import random

import pytest

from dpserve.router.fleet.breaker import Outcome
from dpserve.router.routing.canary import CanarySplit
from dpserve.router.routing.canary_verdict import NOT_WORSE, UNSURE, WORSE, Rule, judge

RULE = Rule(min_requests=30, confidence=0.95, looks=1)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def window(rng: random.Random, n: int, *, ratio: float = 1.0, canary_errors: float = 0.0,
           sigma: float = 0.8, burst: bool = False) -> CanarySplit:
    """`n` attempts a side over 30 s, lognormal TTFT; the canary `ratio` times slower and
    failing `canary_errors` of its attempts. `burst`: from 10 s to 15 s everything is
    4x slower and the canary gets three times its share."""
    clock = Clock()
    split = CanarySplit("r0", 25, baseline_id="r1", baseline_weight_pct=25, clock=clock)
    events = []
    for side in ("r0", "r1"):
        for _ in range(n):
            t = rng.uniform(0, 30)
            if burst and side == "r0" and rng.random() < 0.5:
                t = rng.uniform(10, 15)
            events.append((t, side))
    for t, side in sorted(events):
        clock.now = t
        slow = 4 if burst and 10 <= t < 15 else 1
        ttft = slow * math.exp(rng.gauss(math.log(0.1), sigma)) * (ratio if side == "r0" else 1)
        if side == "r0" and rng.random() < canary_errors:
            split.record(side, Outcome.SERVER_ERROR, None, 300)
        else:
            split.record(side, Outcome.SUCCESS, ttft, 300)
    return split


def outcomes(trials: int, **kw) -> dict[str, int]:
    rng = random.Random(7)
    counts = {WORSE: 0, NOT_WORSE: 0, UNSURE: 0}
    for _ in range(trials):
        counts[judge(window(rng, **kw), RULE).outcome] += 1
    return counts


def test_too_few_answers_judge_nothing():
    v = judge(window(random.Random(0), 20), RULE)
    assert v.outcome == UNSURE and "fewer than the 30 each needs" in v.describe(RULE)


def test_as_fast_and_as_reliable_is_not_worse_in_19_of_20_or_better():
    counts = outcomes(100, n=400)
    assert counts[WORSE] <= 1 and counts[NOT_WORSE] >= 95, counts


def test_slower_but_within_the_ratio_is_not_rolled_back_more_than_the_confidence_says():
    """1.2x: within 1.5x. Judged worse at most 5% of the time (here: never)."""
    counts = outcomes(100, n=200, ratio=1.2)
    assert counts[WORSE] <= 5, counts


def test_twice_as_slow_is_caught_and_never_passed():
    counts = outcomes(100, n=300, ratio=2.0)
    assert counts[NOT_WORSE] == 0 and counts[WORSE] >= 95, counts


def test_five_percent_errors_are_caught_and_never_passed():
    counts = outcomes(100, n=600, canary_errors=0.05)
    assert counts[NOT_WORSE] <= 5 and counts[WORSE] >= 90, counts


def test_a_burst_that_fell_on_the_canary_is_not_taken_for_a_slower_replica():
    counts = outcomes(50, n=300, burst=True)
    assert counts[WORSE] == 0, counts


@pytest.mark.parametrize(("known", "verdict"), [(True, NOT_WORSE), (False, WORSE)])
def test_cache_misses_are_compared_with_cache_misses_where_the_engines_say_which(
        known, verdict):
    """Prompts of one size: a hit prefills 16 new tokens in 50 ms, a miss 1,000 in
    250 ms. The canary missed 60% of the time, its baseline 10% (as fast per token).
    By the uncached tokens the KV events give, like is compared with like; by size
    alone, the canary's misses read as a replica 2-3x slower."""
    rng = random.Random(11)
    clock = Clock()
    split = CanarySplit("r0", 25, baseline_id="r1", baseline_weight_pct=25, clock=clock)
    for i in range(400):
        clock.now = i / 10
        for side, misses in (("r0", 0.6), ("r1", 0.1)):
            miss = rng.random() < misses
            ttft = (0.25 if miss else 0.05) * math.exp(rng.gauss(0, 0.2))
            split.record(side, Outcome.SUCCESS, ttft, 4000,
                         (1000 if miss else 16) if known else None)
    assert judge(split, RULE).ttft.verdict == verdict


def test_the_verdict_says_what_it_compared_and_how_sure_it_is():
    split = window(random.Random(3), 300, ratio=3.0)
    v = judge(split, RULE)
    assert v.outcome == WORSE and v.against == "the baseline r1"
    text = v.describe(RULE)
    assert text.startswith("worse than the baseline r1 at 95% confidence: TTFT ")
    assert "above the 1.5x allowed" in text and "/300 answers" in text
    body = v.to_json()
    assert body["ttft_ratio"]["verdict"] == WORSE and 2 < body["ttft_ratio"]["estimate"] < 4
    assert body["error_rate_difference"]["canary_n"] == 300


def test_a_millisecond_is_never_a_regression_whatever_the_ratio():
    clock = Clock()
    split = CanarySplit("r0", 50, baseline_id="r1", baseline_weight_pct=50, clock=clock)
    for i in range(400):
        clock.now = i / 10
        split.record("r0", Outcome.SUCCESS, 0.002)
        split.record("r1", Outcome.SUCCESS, 0.001)
    assert judge(split, RULE).ttft.verdict == NOT_WORSE  # 2x, but 1 ms under 20 ms slack


def test_bad_requests_say_nothing_about_the_replica():
    split = window(random.Random(4), 300)
    for _ in range(200):
        split.record("r0", Outcome.CLIENT_ERROR, 0.0001)  # 400s answered at once
    v = judge(split, RULE)
    assert v.errors.canary_n == 300 and v.ttft.canary_n == 300


def test_a_baseline_with_too_few_answers_leaves_the_others_to_compare_with():
    split = window(random.Random(5), 300)
    split.baseline.requests = 5
    for _ in range(40):
        split.record("r2", Outcome.SUCCESS, 0.1)
    assert judge(split, RULE).against == "the others"


@pytest.mark.parametrize(("looks", "z"), [(1, 1.645), (8, 2.498)])
def test_each_look_spends_its_share_of_the_error(looks, z):
    assert Rule(looks=looks).z == pytest.approx(z, abs=1e-3)


def test_a_long_window_keeps_a_bounded_uniform_sample(monkeypatch):
    import dpserve.router.routing.canary as canary

    monkeypatch.setattr(canary, "MAX_ANSWERS", 100)
    clock = Clock()
    split = CanarySplit("r0", 50, baseline_id="r1", baseline_weight_pct=50, clock=clock,
                        rng=random.Random(0))
    for i in range(10_000):
        clock.now = i / 100  # 100 s, 20 blocks
        split.record("r0", Outcome.SUCCESS, 0.1 + i / 1e6)
    c = split.canary
    assert c.requests == c.answers == 10_000 and len(c.first_byte_s) == len(c.strata) == 100
    blocks = {s // canary.PER_BLOCK for s in c.strata}
    assert len(blocks) >= 15  # from all through the window, not its first second
    merged = canary.Sample()
    merged.add(c)
    merged.add(c)
    assert len(merged.first_byte_s) == 100 and merged.answers == 20_000


def test_a_snapshot_is_judged_as_the_split_while_the_split_goes_on():
    split = window(random.Random(6), 100, ratio=3.0)
    copy = split.snapshot()
    assert judge(copy, RULE) == judge(split, RULE)
    split.record("r0", Outcome.SUCCESS, 0.1)
    assert copy.canary.requests == 100 and len(copy.canary.first_byte_s) == 100
