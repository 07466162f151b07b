from __future__ import annotations

import pytest

from dpserve.config import POLICIES
from dpserve.router.routing.policies import POLICY_NAMES, AdapterAffinity, RequestInfo, make_policy
from dpserve.router.routing.policies.adapter_affinity import ADAPTER_LOAD_FACTOR

INFO = RequestInfo(route="/v1/completions", session_id="s", prefix="p")


def test_every_configurable_name_builds_the_policy_of_that_name():
    assert set(POLICIES) == {*POLICY_NAMES, "auto"}
    for name in POLICY_NAMES:
        assert make_policy(name).name == name


def test_an_unknown_name_is_refused():
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("fastest")
    with pytest.raises(ValueError, match="unknown policy"):  # settled by the config first
        make_policy("auto")


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_no_candidates_means_no_choice(name):
    assert make_policy(name).select([], INFO) is None


def test_prefix_length_reaches_the_prefix_policy():
    assert make_policy("prefix-affinity", prefix_chars=32).prefix_chars == 32


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_adapter_slots_put_adapter_affinity_in_front_of_the_named_policy(name):
    policy = make_policy(name, adapter_slots=2)
    assert isinstance(policy, AdapterAffinity)
    assert (policy.name, policy.max_loras, policy.inner.name) == (name, 2, name)
    assert "engine_load" in policy.needs  # the engines' adapter reports are scraped
    assert policy.load_factor == ADAPTER_LOAD_FACTOR
    assert make_policy(name, adapter_slots=1, load_factor=1.2).load_factor == 1.2
