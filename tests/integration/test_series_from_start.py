"""A just-started real `dpserve serve` (vLLM replicas) already has a sample of every
`dpserve_*` series its dashboard and alert rules read: the check of
tests/router/telemetry/test_series.py, on the real thing."""

from __future__ import annotations

import httpx
import pytest

from tests.integration.conftest import Deployment
from tests.router.telemetry.test_series import (
    GPU_SERIES,
    KV_SERIES,
    PEER_SERIES,
    PROCESS_SERIES,
    missing,
    sample_names,
)

pytestmark = pytest.mark.vllm


def test_a_started_deployment_has_every_series_the_dashboard_and_rules_read(
        deployment: Deployment):
    text = httpx.get(deployment.base_url + "/metrics", timeout=10).text
    # `dpserve serve` reads GPUs through NVML where it finds them, else the replicas'
    # processes: one of the two sets, never both.
    has_gpus = bool(set(GPU_SERIES) & sample_names(text))
    assert has_gpus != bool(set(PROCESS_SERIES) & sample_names(text))
    # The default policy under `serve` is `kv-aware` (`auto`): its series are read too.
    assert set(KV_SERIES) <= sample_names(text)
    # `serve` is one router for its replicas: it has no peers.
    assert missing(text, {**(PROCESS_SERIES if has_gpus else GPU_SERIES),
                          **PEER_SERIES}) == set()
