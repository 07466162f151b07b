"""The quality gate's comparison against the current version: paired per example, a
bootstrap interval, and the spread of repeated runs; the same checkpoint passes."""

from __future__ import annotations

import random

import pytest

from dpserve.rollout.gate_verdict import compare


def test_the_same_scores_are_no_difference_and_pass_any_margin():
    runs = [[1.0, 0.0, 1.0, 1.0] * 10] * 2
    c = compare(runs, runs)
    assert (c.difference, c.low, c.high, c.spread) == (0.0, 0.0, 0.0, 0.0)
    assert not c.worse(0.0) and c.to_json(0.0)["sure"] is False


def test_a_version_surely_worse_fails_and_one_within_the_margin_does_not():
    current = [[1.0] * 40] * 2
    candidate = [[1.0] * 20 + [0.0] * 20] * 2  # half the answers lost
    c = compare(candidate, current)
    assert c.difference == -0.5 and c.high < -0.3 and c.worse(0.0)
    assert not c.worse(0.5)  # exactly at the margin: not more than it
    assert c.to_json(0.0)["sure"] is True and c.examples == 40 and c.repeats == 2


def test_a_difference_within_the_runs_own_spread_is_noise():
    """Two runs of the current version scored 0.90 and 0.80 (batching flipped four
    greedy answers); the candidate's 0.80 is surely below their mean, 0.85, but by less
    than that."""
    current = [[1.0] * 36 + [0.0] * 4, [1.0] * 32 + [0.0] * 8]
    candidate = [[1.0] * 32 + [0.0] * 8] * 2
    c = compare(candidate, current)
    assert c.spread == pytest.approx(0.1) and c.difference == pytest.approx(-0.05)
    assert c.high < 0 and not c.worse(0.0)


def test_too_few_examples_to_be_sure_pass():
    c = compare([[0.0, 1.0]] * 2, [[1.0, 1.0]] * 2)
    assert c.difference == -0.5 and c.high >= 0 and not c.worse(0.0)


def test_a_checkpoint_as_good_fails_at_most_1_in_20():
    """200 evals of 50 examples: both versions get each example right with its own
    difficulty, independently per run (a noisy engine), at the same rates."""
    rng = random.Random(3)
    failed = 0
    for _ in range(200):
        difficulty = [rng.random() for _ in range(50)]

        def runs(difficulty: list[float] = difficulty) -> list[list[float]]:
            return [[float(rng.random() > d) for d in difficulty] for _ in range(2)]

        failed += compare(runs(), runs(), seed=rng.randrange(1000)).worse(0.0)
    assert failed <= 10  # 5% of 200, with room for chance: 10 is 3 sigma above 1%


def test_a_checkpoint_that_lost_a_fifth_of_its_answers_is_caught():
    rng = random.Random(4)
    caught = 0
    for _ in range(100):
        right = [rng.random() < 0.8 for _ in range(100)]
        current = [[float(r) for r in right]] * 2
        lost = [float(r and rng.random() > 0.25) for r in right]
        caught += compare([lost] * 2, current).worse(0.0)
    assert caught >= 95
