"""Observability of a real deployment: the replicas' vLLM metrics through the router, and
the replicas' processes in the router's own metrics (CPU replicas, no GPU here)."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.conftest import Deployment

pytestmark = pytest.mark.vllm


def scrape(d: Deployment, path: str) -> dict[str, list]:
    text = httpx.get(d.base_url + path, timeout=10).text
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def test_every_replica_vllm_metrics_are_served_by_the_router_with_a_replica_label(deployment):
    engines = scrape(deployment, "/metrics/engines")
    assert {s.labels["replica"] for s in engines["vllm:kv_cache_usage_perc"]} == {"r0", "r1"}


def test_router_metrics_report_each_cpu_replica_process_tree(deployment):
    router = scrape(deployment, "/metrics")
    rss = {s.labels["replica"]: s.value for s in router["dpserve_replica_memory_rss_bytes"]}
    assert rss.keys() == {"r0", "r1"}
    assert all(v > 200 * 2**20 for v in rss.values())  # a vLLM engine, not an empty process
    assert "dpserve_gpu_utilization_ratio" not in router
