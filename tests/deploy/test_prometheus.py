"""deploy/prometheus: the config and rules pass promtool, the alerts fire on the series they
describe, and a real Prometheus server scrapes a running router and answers PromQL."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from dpserve.replicas.launcher import free_port
from tests.conftest import running_router

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
RULES = ROOT / "deploy" / "prometheus" / "rules.yml"
RULES_TEST = Path(__file__).with_name("prometheus_rules_test.yml")
MISSING = ("not installed (Debian package `prometheus`; .ci/run installs it when it runs "
           "as root with apt-get)")


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} {MISSING}")
    return path


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([tool("promtool"), *args], capture_output=True, text=True,
                          timeout=60, check=False)


def test_prometheus_config_and_its_rules_pass_promtool():
    result = promtool("check", "config", str(CONFIG))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 rule files found" in result.stdout


def test_every_alert_fires_on_the_series_it_describes():
    result = promtool("test", "rules", str(RULES_TEST))
    assert result.returncode == 0, result.stdout + result.stderr
    tested = {case["alertname"] for t in yaml.safe_load(RULES_TEST.read_text())["tests"]
              for case in t["alert_rule_test"]}
    alerts = {r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"]
              for r in g["rules"] if "alert" in r}
    assert alerts - tested <= {"DpserveEngineMetricsMissing"}


def test_the_config_scrapes_router_and_federated_engine_metrics():
    jobs = {j["job_name"]: j.get("metrics_path", "/metrics")
            for j in yaml.safe_load(CONFIG.read_text())["scrape_configs"]}
    assert jobs == {"dpserve-router": "/metrics", "dpserve-engines": "/metrics/engines"}


async def query(client: httpx.AsyncClient, base: str, promql: str) -> list[dict]:
    resp = await client.get(base + "/api/v1/query", params={"query": promql})
    resp.raise_for_status()
    return resp.json()["data"]["result"]


async def test_a_real_prometheus_scrapes_the_router_and_answers_promql(fake_replicas, tmp_path):
    prometheus = tool("prometheus")
    a = await fake_replicas("a")
    b = await fake_replicas("b")
    async with running_router([a.url, b.url]) as (router, _):
        target = router.removeprefix("http://")
        config = tmp_path / "prometheus.yml"
        config.write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [
                {"job_name": "dpserve-router", "static_configs": [{"targets": [target]}]},
                {"job_name": "dpserve-engines", "metrics_path": "/metrics/engines",
                 "static_configs": [{"targets": [target]}]},
            ],
        }))
        port = free_port()
        proc = await asyncio.create_subprocess_exec(
            prometheus, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn",
            stdout=asyncio.subprocess.DEVNULL, stderr=(tmp_path / "log").open("wb"),
        )
        base = f"http://127.0.0.1:{port}"
        try:
            async with httpx.AsyncClient(timeout=2.0) as client:
                await client.post(router + "/v1/completions",
                                  json={"model": "fake-model", "prompt": "hi"})
                deadline = time.monotonic() + 30
                ready = engines = None
                while not (ready and engines):
                    assert proc.returncode is None, (tmp_path / "log").read_text()
                    assert time.monotonic() < deadline, (
                        "Prometheus answered no dpserve series within 30 s:\n"
                        + (tmp_path / "log").read_text())
                    with contextlib.suppress(httpx.HTTPError):
                        ready = await query(client, base, "dpserve_replicas_ready")
                        engines = await query(
                            client, base, "sum by (replica) (vllm:request_success_total)")
                    await asyncio.sleep(0.25)
                rules = (await client.get(base + "/api/v1/rules")).json()["data"]["groups"]
        finally:
            if proc.returncode is None:
                proc.kill()
            await proc.wait()
    assert ready[0]["value"][1] == "2"
    assert ready[0]["metric"]["job"] == "dpserve-router"
    assert {r["metric"]["replica"] for r in engines} == {"r0", "r1"}
    assert sum(float(r["value"][1]) for r in engines) == 1.0
    assert {g["name"] for g in rules} == {"dpserve-serving", "dpserve-gpus", "dpserve-deploys"}
