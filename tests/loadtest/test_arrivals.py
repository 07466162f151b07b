import math

import numpy as np
import pytest

from loadtest.arrivals import RampUp, arrival_offsets, rate_at


def test_an_infinite_rate_sends_everything_at_once():
    assert arrival_offsets(4, request_rate=math.inf) == [0.0, 0.0, 0.0, 0.0]


def test_infinite_burstiness_is_exactly_periodic():
    assert arrival_offsets(4, request_rate=4.0, burstiness=math.inf) == [0.25, 0.5, 0.75, 1.0]


@pytest.mark.parametrize("burstiness", [0.5, 1.0, 3.0])
def test_a_fixed_rate_ends_exactly_at_n_over_rate(burstiness):
    offsets = arrival_offsets(50, request_rate=10.0, burstiness=burstiness, seed=3)
    assert offsets[-1] == pytest.approx(5.0, abs=1e-12)
    assert offsets == sorted(offsets) and offsets[0] > 0


def test_the_schedule_is_reproducible_from_its_seed():
    a = arrival_offsets(20, request_rate=5.0, seed=1)
    assert a == arrival_offsets(20, request_rate=5.0, seed=1)
    assert a != arrival_offsets(20, request_rate=5.0, seed=2)


@pytest.mark.parametrize(("burstiness", "cv"), [(1.0, 1.0), (0.25, 2.0), (4.0, 0.5)])
def test_gaps_are_gamma_distributed_with_mean_one_over_rate(burstiness, cv):
    """Burstiness b: gamma shape b, so the gaps' coefficient of variation is 1/sqrt(b)."""
    gaps = np.diff([0.0, *arrival_offsets(20_000, request_rate=8.0, burstiness=burstiness)])
    assert gaps.mean() == pytest.approx(1 / 8, rel=1e-9)  # rescaled to n / rate exactly
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.05)


def test_linear_ramp_up_moves_the_rate_evenly_over_the_requests():
    ramp = RampUp(strategy="linear", start_rps=1.0, end_rps=9.0)
    assert [rate_at(i, 5, math.inf, ramp) for i in range(5)] == [1.0, 3.0, 5.0, 7.0, 9.0]


def test_exponential_ramp_up_multiplies_the_rate():
    ramp = RampUp(strategy="exponential", start_rps=1.0, end_rps=9.0)
    assert [rate_at(i, 3, math.inf, ramp) for i in range(3)] == [1.0, 3.0, 9.0]


def test_ramp_up_gaps_follow_the_current_rate():
    ramp = RampUp(strategy="linear", start_rps=1.0, end_rps=4.0)
    offsets = arrival_offsets(4, request_rate=math.inf, burstiness=math.inf, ramp_up=ramp)
    assert offsets == pytest.approx([1.0, 1.5, 1.8333333333, 2.0833333333])


def test_without_ramp_up_the_rate_is_constant():
    assert rate_at(3, 10, 2.5, None) == 2.5


@pytest.mark.parametrize("kw", [{"burstiness": 0.0}, {"request_rate": -1.0}])
def test_nonsense_settings_are_refused(kw):
    with pytest.raises(ValueError):
        arrival_offsets(3, **{"request_rate": 1.0, **kw})
