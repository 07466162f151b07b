"""docs/metrics.md's table lists every series dpserve exports."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client import CollectorRegistry

from dpserve.metrics.fake_nvml import FakeNvml, fake_gpus
from dpserve.metrics.gpu import GpuCollector
from dpserve.metrics.process import ProcessCollector
from dpserve.router.fleet.pool import Replica, ReplicaPool
from dpserve.router.telemetry.metrics import RouterMetrics

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def exported() -> set[str]:
    """Every dpserve family as the docs name it: counters with `_total`."""
    registry = RouterMetrics(ReplicaPool([Replica(id="r0", url="http://127.0.0.1:1")])).registry
    gpus = GpuCollector.open(FakeNvml(fake_gpus(1)))
    assert gpus is not None
    registry.register(gpus)
    registry.register(ProcessCollector(dict))
    return {f.name + "_total" if f.type == "counter" else f.name
            for f in CollectorRegistry.collect(registry)}


def test_readme_metrics_table_lists_every_exported_series():
    section = DOC.read_text()
    documented = set(re.findall(r"^\| `(dpserve_\w+)`", section, flags=re.M))
    assert exported() - documented == set(), "missing from docs/metrics.md's table"
