"""deploy/grafana/dpserve.json: importable, and every query names a series that exists.

A series exists if dpserve exports it (the router's registry, the NVML and
process collectors) or vLLM does (names read from the installed vLLM's
`v1/metrics/loggers.py`, where its Prometheus metrics are declared).
"""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry

from dpserve.metrics.fake_nvml import FakeNvml, fake_gpus
from dpserve.metrics.gpu import GpuCollector
from dpserve.metrics.process import ProcessCollector
from dpserve.router.fleet.pool import Replica, ReplicaPool
from dpserve.router.kv.decisions import CACHED_BUCKETS, FALLBACK_REASONS, KVRoutingStats
from dpserve.router.kv.index import KVIndex
from dpserve.router.kv.metrics import KVCollector
from dpserve.router.kv.subscriber import FeedStats
from dpserve.router.peers.channel import ChannelStats
from dpserve.router.peers.metrics import PeerCollector
from dpserve.router.peers.state import PeerState
from dpserve.router.telemetry.metrics import RouterMetrics

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "dpserve.json"
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
            "gauge": ("",), "info": ("_info",), "summary": ("", "_sum", "_count")}
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and",
             "or", "unless", "offset", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression reads (not functions, labels or keywords)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)  # strings
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", expr)  # matchers, ranges
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    expr = re.sub(r"\b\d+(\.\d+)?([eE][+-]?\d+)?\b", "", expr)  # numbers
    names = set()
    for match in re.finditer(r"(?<![\w:.])[a-zA-Z_:][\w:]*", expr):  # not `m` of `5m`
        if expr[match.end():].lstrip().startswith("(") or match.group().lower() in _KEYWORDS:
            continue
        names.add(match.group())
    return names


def test_metric_names_are_read_from_promql():
    assert metric_names(
        'histogram_quantile(0.99, sum by (le, replica) '
        '(rate(vllm:time_to_first_token_seconds_bucket{replica=~"$replica"}[5m]))) > 2e9'
    ) == {"vllm:time_to_first_token_seconds_bucket"}
    assert metric_names("a / on (x) group_left b and sum(c) without (d) offset 5m") == {
        "a", "b", "c"}


def exposed(family_name: str, kind: str) -> set[str]:
    base = family_name.removesuffix("_total") if kind == "counter" else family_name
    return {base + s for s in SUFFIXES.get(kind, ("",))}


def kv_collector() -> KVCollector:
    """The `kv-aware` series, with one replica followed and one decision of each kind."""
    index = KVIndex()
    index.apply("r0", 0, [])
    stats = KVRoutingStats(on_events=1, fallbacks=dict.fromkeys(FALLBACK_REASONS, 1),
                           cached_histogram=[0] * (len(CACHED_BUCKETS) + 1))
    return KVCollector(index, lambda: {"r0": "following"}, stats,
                       lambda: {"r0": FeedStats("tcp://r0:5557", last_at=0.0)})


class FakeLink:
    """What the peer series read: a link's state and its channel's counters."""

    state = PeerState(ReplicaPool([]))
    channel_stats = ChannelStats()


def dpserve_series() -> set[str]:
    registry = RouterMetrics(ReplicaPool([Replica(id="r0", url="http://127.0.0.1:1")])).registry
    gpus = GpuCollector.open(FakeNvml(fake_gpus(1)))
    assert gpus is not None
    registry.register(gpus)
    registry.register(ProcessCollector(dict))
    registry.register(kv_collector())
    registry.register(PeerCollector(FakeLink()))
    names: set[str] = set()
    for family in CollectorRegistry.collect(registry):
        names |= exposed(family.name, family.type)
    return names


def vllm_series() -> set[str]:
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        pytest.skip("vLLM is not installed: cannot list its metric names")
    loggers = Path(spec.origin).parent / "v1" / "metrics" / "loggers.py"
    names: set[str] = set()
    for node in ast.walk(ast.parse(loggers.read_text())):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        kind = next((k for k in ("counter", "gauge", "histogram") if k in node.func.attr), None)
        for kw in node.keywords:
            if (kind and kw.arg == "name" and isinstance(kw.value, ast.Constant)
                    and str(kw.value.value).startswith("vllm:")):
                names |= exposed(kw.value.value, kind)
    assert "vllm:kv_cache_usage_perc" in names, f"no vLLM metric names found in {loggers}"
    return names


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def expressions() -> list[tuple[str, str]]:
    return [(panel["title"], target["expr"]) for panel in dashboard()["panels"]
            for target in panel.get("targets", [])]


def test_dashboard_is_importable_json_with_unique_panel_ids():
    dash = dashboard()
    assert dash["uid"] == "dpserve" and dash["title"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    assert all({"h", "w", "x", "y"} <= p["gridPos"].keys() for p in dash["panels"])
    assert {v["name"] for v in dash["templating"]["list"]} == {"datasource", "replica"}


def test_every_dashboard_query_names_series_that_are_exported():
    known = dpserve_series() | vllm_series()
    unknown = {(title, name) for title, expr in expressions()
               for name in metric_names(expr) - known}
    assert not unknown, f"queries name series nothing exports: {sorted(unknown)}"


def test_the_dashboard_shows_what_an_operator_asks_first():
    names = set().union(*(metric_names(e) for _, e in expressions()))
    for wanted in ("dpserve_gpu_utilization_ratio", "dpserve_gpu_memory_used_bytes",
                   "dpserve_gpu_power_watts", "dpserve_requests_total",
                   "dpserve_replica_in_flight_requests",
                   "vllm:time_to_first_token_seconds_bucket",
                   "vllm:e2e_request_latency_seconds_bucket", "vllm:generation_tokens_total",
                   "vllm:kv_cache_usage_perc", "dpserve_replica_cpu_utilization_ratio"):
        assert wanted in names, wanted


def test_every_dashboard_query_is_valid_promql(tmp_path):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package `prometheus`)")
    # Grafana's variables, as Grafana substitutes them, then each query as a recording rule.
    rules = [{"record": f"dashboard:query_{i}",
              "expr": expr.replace("$__rate_interval", "1m").replace("$replica", ".*")}
             for i, (_, expr) in enumerate(expressions())]
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
