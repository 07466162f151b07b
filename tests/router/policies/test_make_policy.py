from __future__ import annotations

import pytest

from dpserve.config import POLICIES
from dpserve.router.policies import POLICY_NAMES, RequestInfo, make_policy

INFO = RequestInfo(route="/v1/completions", session_id="s", prefix="p")


def test_every_configurable_name_builds_the_policy_of_that_name():
    assert POLICIES == POLICY_NAMES
    for name in POLICY_NAMES:
        assert make_policy(name).name == name


def test_an_unknown_name_is_refused():
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("fastest")


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_no_candidates_means_no_choice(name):
    assert make_policy(name).select([], INFO) is None


def test_prefix_length_reaches_the_prefix_policy():
    assert make_policy("prefix-affinity", prefix_chars=32).prefix_chars == 32
