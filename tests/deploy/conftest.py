"""Fixtures of the deployment tests."""

from __future__ import annotations

import pytest

from tests.deploy.k8s import K8S, OVERLAYS, Obj, render


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request: pytest.FixtureRequest) -> tuple[str, list[Obj]]:
    """(name, rendered objects) of each Kubernetes overlay."""
    return request.param, render(K8S / "overlays" / request.param)
