from __future__ import annotations

import random

import pytest

from dpserve.router.fleet.breaker import Outcome
from dpserve.router.forward.retry import backoff, is_retryable


@pytest.mark.parametrize(("outcome", "status", "stream", "retry"), [
    (Outcome.CONNECT_FAILED, None, True, True),
    (Outcome.CONNECT_TIMEOUT, None, True, True),
    (Outcome.DISCONNECTED, None, False, True),
    (Outcome.SERVER_ERROR, 502, True, True),
    (Outcome.SERVER_ERROR, 503, False, True),
    (Outcome.SERVER_ERROR, 504, False, True),
    (Outcome.SERVER_ERROR, 500, False, False),
    (Outcome.TIMEOUT, None, False, True),   # a whole answer never came: try elsewhere
    (Outcome.TIMEOUT, None, True, False),   # the stream was accepted; its twin would queue too
    (Outcome.CLIENT_ERROR, 400, False, False),
    (Outcome.SUCCESS, 200, False, False),
    (Outcome.ABORTED, None, False, False),
])
def test_what_may_be_retried_before_the_client_saw_anything(outcome, status, stream, retry):
    assert is_retryable(outcome, status=status, bytes_sent_to_client=False,
                        stream=stream) is retry


@pytest.mark.parametrize("outcome", list(Outcome))
def test_nothing_is_retried_once_a_byte_reached_the_client(outcome):
    assert not is_retryable(outcome, status=503, bytes_sent_to_client=True, stream=False)


def test_backoff_doubles_from_the_base_up_to_the_cap():
    delays = [backoff(n, base=0.1, cap=1.0, jitter=False) for n in range(1, 7)]
    assert delays == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0])


def test_backoff_stays_at_the_cap_for_any_attempt_number():
    assert backoff(10_000, base=0.1, cap=2.0, jitter=False) == 2.0


def test_full_jitter_draws_between_zero_and_the_exponential_delay():
    drawn = [backoff(3, base=0.1, cap=1.0, rng=random.Random(5)) for _ in range(3)]
    expected = random.Random(5).uniform(0.0, 0.4)
    assert drawn == [expected] * 3
    rng = random.Random(1)
    assert all(0.0 <= backoff(4, base=0.1, cap=1.0, rng=rng) <= 0.8 for _ in range(200))


def test_attempts_are_counted_from_one():
    with pytest.raises(ValueError, match="attempt"):
        backoff(0)
