from __future__ import annotations

import asyncio

import pytest

from dpserve.router.fleet.breaker import BreakerState, CircuitBreaker, Outcome, classify
from dpserve.router.upstream.client import ConnectFailed, ConnectTimeout, Disconnected

CLOSED, OPEN, HALF_OPEN = BreakerState.CLOSED, BreakerState.OPEN, BreakerState.HALF_OPEN


@pytest.mark.parametrize(("status", "error", "outcome"), [
    (200, None, Outcome.SUCCESS),
    (307, None, Outcome.SUCCESS),
    (400, None, Outcome.CLIENT_ERROR),
    (404, None, Outcome.CLIENT_ERROR),
    (429, None, Outcome.CLIENT_ERROR),
    (500, None, Outcome.SERVER_ERROR),
    (503, None, Outcome.SERVER_ERROR),
    (None, ConnectFailed(111, "refused"), Outcome.CONNECT_FAILED),
    (None, ConnectTimeout("no connection within 5 s"), Outcome.CONNECT_TIMEOUT),
    (None, Disconnected("the replica closed the connection"), Outcome.DISCONNECTED),
    (None, ConnectionResetError(104, "reset"), Outcome.DISCONNECTED),
    (None, TimeoutError(), Outcome.TIMEOUT),
    (None, asyncio.CancelledError(), Outcome.ABORTED),
    (None, ValueError("a router bug"), Outcome.ABORTED),
    (None, None, Outcome.ABORTED),
    (200, Disconnected("cut mid-body"), Outcome.DISCONNECTED),  # the error wins
])
def test_classify(status, error, outcome):
    assert classify(status, error) is outcome


def test_only_replica_faults_count_as_failures():
    assert {o for o in Outcome if o.is_failure} == {
        Outcome.SERVER_ERROR, Outcome.CONNECT_FAILED, Outcome.CONNECT_TIMEOUT,
        Outcome.DISCONNECTED, Outcome.TIMEOUT}


def fail(breaker: CircuitBreaker, now: float, n: int = 1,
         outcome: Outcome = Outcome.SERVER_ERROR) -> None:
    for _ in range(n):
        permit = breaker.allow(now)
        assert permit is not None
        breaker.record(permit, outcome, now)


def opened(now: float = 0.0, **settings) -> CircuitBreaker:
    breaker = CircuitBreaker(**{"failure_threshold": 3, "cooldown_s": 10.0, **settings})
    fail(breaker, now, 3)
    assert breaker.state(now) is OPEN
    return breaker


def test_the_breaker_opens_after_n_consecutive_failures():
    breaker = CircuitBreaker(failure_threshold=3)
    fail(breaker, 0.0, 2, Outcome.CONNECT_FAILED)
    assert breaker.state(0.0) is CLOSED
    fail(breaker, 0.0, 1, Outcome.TIMEOUT)
    assert breaker.state(0.0) is OPEN
    assert breaker.allow(0.0) is None


def test_a_success_resets_the_streak():
    breaker = CircuitBreaker(failure_threshold=3)
    fail(breaker, 0.0, 2)
    fail(breaker, 0.0, 1, Outcome.SUCCESS)
    fail(breaker, 0.0, 2)
    assert breaker.state(0.0) is CLOSED
    assert breaker.consecutive_failures == 2


def test_client_errors_neither_count_nor_reset_the_streak():
    breaker = CircuitBreaker(failure_threshold=3)
    fail(breaker, 0.0, 2)
    fail(breaker, 0.0, 50, Outcome.CLIENT_ERROR)
    assert breaker.state(0.0) is CLOSED
    fail(breaker, 0.0, 1)
    assert breaker.state(0.0) is OPEN


def test_an_open_breaker_refuses_until_the_cooldown_is_over():
    breaker = opened(now=100.0)
    assert not breaker.available(109.9)
    assert breaker.allow(109.9) is None
    assert breaker.state(110.0) is HALF_OPEN


def test_half_open_lets_exactly_one_probe_through():
    breaker = opened()
    assert breaker.available(10.0)
    assert breaker.available(10.0)  # asking grants nothing
    probe = breaker.allow(10.0)
    assert probe is not None and probe.probe
    assert not breaker.available(10.5)
    assert breaker.allow(10.5) is None


def test_a_successful_probe_closes_the_breaker():
    breaker = opened()
    breaker.record(breaker.allow(10.0), Outcome.SUCCESS, 11.0)
    assert breaker.state(11.0) is CLOSED
    assert breaker.allow(11.0) is not None


def test_a_failed_probe_reopens_it_for_a_whole_cooldown_from_the_failure():
    breaker = opened()
    breaker.record(breaker.allow(10.0), Outcome.TIMEOUT, 15.0)
    assert breaker.state(24.9) is OPEN
    assert breaker.state(25.0) is HALF_OPEN


def test_a_probe_answered_with_a_client_error_lets_another_request_probe():
    breaker = opened()
    breaker.record(breaker.allow(10.0), Outcome.CLIENT_ERROR, 10.5)
    assert breaker.state(10.5) is HALF_OPEN
    assert breaker.allow(10.5) is not None


def test_several_probes_must_all_succeed_when_configured():
    breaker = opened(probes=2)
    first, second = breaker.allow(10.0), breaker.allow(10.0)
    assert first is not None and second is not None and breaker.allow(10.0) is None
    breaker.record(first, Outcome.SUCCESS, 11.0)
    assert breaker.state(11.0) is HALF_OPEN
    breaker.record(second, Outcome.SUCCESS, 11.0)
    assert breaker.state(11.0) is CLOSED


def test_a_slow_request_from_before_the_breaker_opened_cannot_decide_the_probe():
    breaker = CircuitBreaker(failure_threshold=3, cooldown_s=10.0)
    slow = breaker.allow(0.0)
    fail(breaker, 0.0, 3)
    probe = breaker.allow(10.0)
    breaker.record(slow, Outcome.SUCCESS, 10.5)  # started while closed: ignored
    assert breaker.state(10.5) is HALF_OPEN
    assert breaker.allow(10.5) is None  # the probe is still out
    breaker.record(probe, Outcome.SUCCESS, 11.0)
    assert breaker.state(11.0) is CLOSED


def test_failures_recorded_while_open_do_not_extend_the_cooldown():
    breaker = CircuitBreaker(failure_threshold=1, cooldown_s=10.0)
    in_flight = [breaker.allow(0.0) for _ in range(3)]
    breaker.record(in_flight[0], Outcome.SERVER_ERROR, 5.0)  # opens
    for permit in in_flight[1:]:
        breaker.record(permit, Outcome.SERVER_ERROR, 9.0)
    assert breaker.state(15.0) is HALF_OPEN


@pytest.mark.parametrize("settings", [{"failure_threshold": 0}, {"cooldown_s": -1.0},
                                      {"probes": 0}])
def test_nonsense_settings_are_refused(settings):
    with pytest.raises(ValueError):
        CircuitBreaker(**settings)
