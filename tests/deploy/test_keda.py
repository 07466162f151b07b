"""The optional KEDA autoscaling component (deploy/k8s/components/autoscaling), added to
each overlay the way deploy/README.md says (the engines' entry taken out of the
overlay's `replicas:`): what it renders, that its ScaledObject is valid, and that it
scales on a series the routers really export, scraped by the job that really exists.

KEDA's CRD cannot be downloaded here (no network besides package registries), and no
package on PyPI that installs here ships it: `cloudcoil-models-keda` (Pydantic models
generated from KEDA 2.20's CRDs) needs Python 3.14. So `SCALED_OBJECT_SCHEMA` below is
written by hand: the subset of `scaledobjects.keda.sh` v1alpha1 this component uses,
taken from KEDA's documented ScaledObject spec and its prometheus trigger (keda.sh, docs
2.17 to 2.20) and checked field by field against those generated models (names, types,
minimums, the fallback behaviours). Like the CRD's structural schema under
`kubectl apply`'s strict field validation, it refuses fields it does not know.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from dpserve.router.fleet.pool import ReplicaPool
from dpserve.router.telemetry.metrics import RouterMetrics
from tests.deploy.k8s import (
    K8S,
    KUBERNETES_VERSIONS,
    OVERLAYS,
    Obj,
    find,
    pod_spec,
    render_kubectl,
    render_subset,
)
from tests.deploy.test_grafana import metric_names

COMPONENT = K8S / "components" / "autoscaling"

_INT = {"type": "integer", "format": "int32"}
_HPA_RULES = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "stabilizationWindowSeconds": {**_INT, "minimum": 0, "maximum": 3600},
        "selectPolicy": {"enum": ["Max", "Min", "Disabled"]},
        "policies": {
            "type": "array",
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["type", "value", "periodSeconds"],
                "properties": {
                    "type": {"enum": ["Pods", "Percent"]},
                    "value": {**_INT, "exclusiveMinimum": 0},
                    "periodSeconds": {**_INT, "exclusiveMinimum": 0, "maximum": 1800},
                },
            },
        },
    },
}
SCALED_OBJECT_SCHEMA: Obj = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"},
        "kind": {"const": "ScaledObject"},
        "metadata": {
            "type": "object",
            "required": ["name", "namespace"],
            "properties": {"name": {"type": "string"}, "namespace": {"type": "string"},
                           "labels": {"type": "object",
                                      "additionalProperties": {"type": "string"}}},
        },
        "spec": {
            "type": "object",
            "required": ["scaleTargetRef", "triggers"],
            "additionalProperties": False,
            "properties": {
                "scaleTargetRef": {
                    "type": "object",
                    "required": ["name"],
                    "additionalProperties": False,
                    "properties": {"apiVersion": {"type": "string"},
                                   "kind": {"type": "string"},
                                   "name": {"type": "string", "minLength": 1},
                                   "envSourceContainerName": {"type": "string"}},
                },
                "pollingInterval": {**_INT, "minimum": 1},
                "cooldownPeriod": {**_INT, "minimum": 0},
                "initialCooldownPeriod": {**_INT, "minimum": 0},
                "idleReplicaCount": {**_INT, "minimum": 0},
                "minReplicaCount": {**_INT, "minimum": 0},
                "maxReplicaCount": {**_INT, "minimum": 1},
                "fallback": {
                    "type": "object",
                    "required": ["failureThreshold", "replicas"],
                    "additionalProperties": False,
                    "properties": {
                        "failureThreshold": {**_INT, "minimum": 0},
                        "replicas": {**_INT, "minimum": 0},
                        "behavior": {"enum": ["static", "currentReplicas",
                                              "currentReplicasIfHigher",
                                              "currentReplicasIfLower"]},
                    },
                },
                "advanced": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "restoreToOriginalReplicaCount": {"type": "boolean"},
                        "horizontalPodAutoscalerConfig": {
                            "type": "object",
                            "additionalProperties": False,
                            "properties": {
                                "name": {"type": "string"},
                                "behavior": {
                                    "type": "object",
                                    "additionalProperties": False,
                                    "properties": {"scaleUp": _HPA_RULES,
                                                   "scaleDown": _HPA_RULES},
                                },
                            },
                        },
                    },
                },
                "triggers": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["type", "metadata"],
                        "additionalProperties": False,
                        "properties": {
                            "type": {"type": "string", "minLength": 1},
                            "name": {"type": "string"},
                            "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                            "useCachedMetrics": {"type": "boolean"},
                            # The CRD types trigger metadata as a map of strings: a bare
                            # number (threshold: 32) is refused by the API server.
                            "metadata": {"type": "object",
                                         "additionalProperties": {"type": "string"}},
                        },
                    },
                },
            },
        },
    },
}
PROMETHEUS_TRIGGER_METADATA = {
    "required": {"serverAddress", "query", "threshold"},
    "optional": {"activationThreshold", "namespace", "customHeaders", "ignoreNullValues",
                 "queryParameters", "unsafeSsl", "timeout"},
}
"""The prometheus scaler's metadata keys (keda.sh/docs/2.20/scalers/prometheus)."""


def render_with_component(overlay: str, tmp_path: Path) -> list[Obj]:
    """`overlay` as deploy/README.md tells to autoscale it: the component added, the
    engines taken out of its `replicas:`."""
    source = K8S / "overlays" / overlay
    k = yaml.safe_load((source / "kustomization.yaml").read_text())
    k["replicas"] = [r for r in k.get("replicas", []) if r["name"] != "dpserve-engine"]
    k["resources"] = [os.path.relpath(source / r, tmp_path) for r in k["resources"]]
    k["components"] = [os.path.relpath(COMPONENT, tmp_path)]
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(k))
    if shutil.which("kubectl"):
        return render_kubectl(tmp_path)
    # The subset renderer knows no components: the overlay, then the component by hand.
    del k["components"]
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(k))
    objs = render_subset(tmp_path)
    component = yaml.safe_load((COMPONENT / "kustomization.yaml").read_text())
    assert component["kind"] == "Component"
    for res in component["resources"]:
        objs += [d for d in yaml.safe_load_all((COMPONENT / res).read_text()) if d]
    for patch in component.get("patches", []):
        target = find(objs, patch["target"]["kind"], patch["target"]["name"])
        for op in yaml.safe_load(patch["patch"]):
            assert op == {"op": "remove", "path": "/spec/replicas"}, op
            del target["spec"]["replicas"]
    return objs


@pytest.fixture(params=OVERLAYS)
def autoscaled(request: pytest.FixtureRequest, tmp_path: Path) -> list[Obj]:
    return render_with_component(request.param, tmp_path)


def scaled_object(objs: list[Obj]) -> Obj:
    return find(objs, "ScaledObject", "dpserve-engine")


def trigger(objs: list[Obj]) -> Obj:
    (only,) = scaled_object(objs)["spec"]["triggers"]
    return only


def test_the_scaled_object_validates_against_kedas_schema(autoscaled):
    jsonschema.validate(scaled_object(autoscaled), SCALED_OBJECT_SCHEMA)


def test_the_schema_refuses_what_the_crd_refuses(autoscaled):
    obj = scaled_object(autoscaled)
    for broken in ({**obj["spec"], "minReplicas": 2},  # an HPA field, not KEDA's
                   {**obj["spec"], "triggers": []},
                   {**obj["spec"], "triggers": [{**obj["spec"]["triggers"][0],
                                                 "metadata": {"threshold": 32}}]}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({**obj, "spec": broken}, SCALED_OBJECT_SCHEMA)


def test_the_prometheus_trigger_has_the_keys_the_scaler_reads(autoscaled):
    t = trigger(autoscaled)
    assert t["type"] == "prometheus"
    keys = set(t["metadata"])
    assert PROMETHEUS_TRIGGER_METADATA["required"] <= keys
    assert keys - PROMETHEUS_TRIGGER_METADATA["required"] <= PROMETHEUS_TRIGGER_METADATA[
        "optional"]
    assert float(t["metadata"]["threshold"]) > 0
    # an empty answer (no router series) is an error, so the fallback holds the fleet
    assert t["metadata"]["ignoreNullValues"] == "false"


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_other_object_still_validates_against_the_kubernetes_schema(autoscaled,
                                                                          version):
    for obj in autoscaled:
        if obj["kind"] != "ScaledObject":
            kubernetes_validate.validate(obj, version, strict=True)


def test_it_scales_the_engine_statefulset_which_leaves_its_count_to_the_autoscaler(
        autoscaled):
    spec = scaled_object(autoscaled)["spec"]
    ref = spec["scaleTargetRef"]
    engines = find(autoscaled, "StatefulSet", ref["name"])
    assert (ref["apiVersion"], ref["kind"]) == (engines["apiVersion"], engines["kind"])
    assert (scaled_object(autoscaled)["metadata"]["namespace"]
            == engines["metadata"]["namespace"])
    assert "replicas" not in engines["spec"]  # else each `kubectl apply` resets the fleet
    assert 2 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    assert spec["fallback"]["replicas"] >= spec["minReplicaCount"]


def test_scaling_down_drains_one_engine_at_a_time_within_its_grace_period(autoscaled):
    behavior = scaled_object(autoscaled)["spec"]["advanced"]["horizontalPodAutoscalerConfig"][
        "behavior"]
    down = behavior["scaleDown"]
    assert [p["type"] for p in down["policies"]] == ["Pods"]
    assert all(p["value"] == 1 for p in down["policies"])
    engines = find(autoscaled, "StatefulSet", "dpserve-engine")
    spec = pod_spec(engines)
    (vllm,) = spec["containers"]
    assert "preStop" in vllm["lifecycle"]  # the drain (tested in test_k8s.py)
    # the next engine is not removed before the previous one's drain may have ended
    assert min(p["periodSeconds"] for p in down["policies"]) >= 300
    assert down["stabilizationWindowSeconds"] >= 300
    assert behavior["scaleUp"]["stabilizationWindowSeconds"] == 0


def test_the_query_reads_a_series_the_routers_export_from_the_routers_scrape_job(autoscaled):
    t = trigger(autoscaled)
    query = t["metadata"]["query"]
    exported = {f.name for f in RouterMetrics(ReplicaPool([])).registry.collect()}
    assert metric_names(query) == {"dpserve_requests_outstanding"} <= exported
    scrape = yaml.safe_load(find(autoscaled, "ConfigMap", "dpserve-prometheus-scrape")[
        "data"]["scrape-configs.yml"])
    jobs = {job["job_name"] for job in scrape["scrape_configs"]}
    assert 'job="dpserve-router"' in query and "dpserve-router" in jobs
    assert t["metricType"] == "AverageValue"  # engines = ceil(demand / threshold)
    assert query.startswith("sum(")  # one number: every router's demand together


def component_objects() -> list[Obj]:
    return [d for d in yaml.safe_load_all((COMPONENT / "scaledobject.yaml").read_text()) if d]


def test_the_query_is_valid_promql(tmp_path):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian package `prometheus`)")
    query = trigger(component_objects())["metadata"]["query"]
    rules = tmp_path / "rules.yml"
    rules.write_text(yaml.safe_dump({"groups": [{"name": "keda", "rules": [
        {"record": "dpserve:engine_demand", "expr": query}]}]}))
    done = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
