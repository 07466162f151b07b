"""`python -m benchmarks.router.overhead --router-cores K`: each router gets K cores of its
own, the upstreams and the load generator the others, and a machine too small says so."""

from __future__ import annotations

import pytest

from benchmarks.common import services as _services


@pytest.mark.parametrize(("cores", "k"), [(16, 1), (16, 4), (16, 7), (3, 1), (5, 2)])
def test_the_router_gets_k_cores_of_its_own(monkeypatch, cores, k):
    monkeypatch.setattr(_services.os, "sched_getaffinity", lambda _: set(range(cores)))
    placement = _services.plan_placement(True, k)
    assert placement.router == frozenset(range(cores - k, cores))
    assert len(placement.upstream) == k and not placement.upstream & placement.router
    assert placement.load and not placement.load & (placement.upstream | placement.router)
    assert placement.load | placement.upstream | placement.router == set(range(cores))


def test_two_cores_keep_the_one_core_layout(monkeypatch):
    monkeypatch.setattr(_services.os, "sched_getaffinity", lambda _: {0, 1})
    placement = _services.plan_placement(True)
    assert placement.router == {1} and placement.load == placement.upstream == {0}


def test_too_few_cores_for_k_is_refused_with_the_count(monkeypatch):
    monkeypatch.setattr(_services.os, "sched_getaffinity", lambda _: {0, 1, 2, 3})
    with pytest.raises(ValueError, match=r"--router-cores 2 needs 5 cores.*has 4"):
        _services.plan_placement(True, 2)
