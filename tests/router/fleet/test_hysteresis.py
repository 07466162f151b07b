from __future__ import annotations

import pytest

from dpserve.router.fleet.hysteresis import Verdict, next_state
from dpserve.router.fleet.pool import ReplicaState

READY, DOWN, STARTING = ReplicaState.READY, ReplicaState.DOWN, ReplicaState.STARTING


def run(state: ReplicaState, results: str, *, down_after: int = 2, up_after: int = 3
        ) -> list[ReplicaState]:
    """States after each result of `results` ('+' healthy, '-' not)."""
    successes = failures = 0
    states = []
    for r in results:
        state, successes, failures = next_state(state, r == "+", successes, failures,
                                                down_after=down_after, up_after=up_after)
        states.append(state)
    return states


def test_a_ready_replica_goes_down_only_after_consecutive_failures():
    assert run(READY, "-+-+--") == [READY, READY, READY, READY, READY, DOWN]


def test_a_down_replica_comes_back_only_after_consecutive_successes():
    assert run(DOWN, "++-+++") == [DOWN, DOWN, DOWN, DOWN, DOWN, READY]


def test_a_starting_replica_turns_ready_like_a_down_one():
    assert run(STARTING, "+++", up_after=3) == [STARTING, STARTING, READY]
    assert run(STARTING, "-----") == [STARTING] * 5  # never down before it was ever up


def test_thresholds_of_one_flip_at_once():
    assert run(READY, "-+", down_after=1, up_after=1) == [DOWN, READY]


def test_each_result_resets_the_other_streak():
    assert next_state(READY, True, 4, 1, down_after=2, up_after=1) == Verdict(READY, 5, 0)
    assert next_state(READY, False, 4, 1, down_after=3, up_after=1) == Verdict(READY, 0, 2)


@pytest.mark.parametrize("state", [ReplicaState.DRAINING, ReplicaState.RELOADING])
def test_replicas_held_by_the_admin_path_are_left_alone(state):
    assert next_state(state, False, 0, 9, down_after=1, up_after=1) == Verdict(state, 0, 9)
