"""The Kubernetes manifests (deploy/k8s), rendered per overlay and checked against
Kubernetes' own schemas (kubernetes-validate) and against dpserve's real command line:
every flag in a manifest parses with dpserve's argparse parser (and the engines' with
vLLM's), and ports, probe paths and Service names agree with what the programs do.

Rendering uses `kubectl kustomize` where kubectl is installed; elsewhere a small
renderer for the subset of Kustomize these manifests use (`render_subset`), which is
checked to render exactly what kubectl renders wherever both are present.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import http.server
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from dpserve.cli import _flags, _parser
from dpserve.config import RouterConfig, build_router_config, is_loopback_host, parse_target
from dpserve.finetune.config import build_finetune_config
from dpserve.router.app import Router, build_app
from dpserve.router.pool import ReplicaPool

ROOT = Path(__file__).parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ["single-node", "multi-node"]
# The oldest Kubernetes the manifests target (the preStop `sleep` action is on by
# default from 1.30) and the newest the validator knows.
KUBERNETES_VERSIONS = ["1.30.0", kubernetes_validate.latest_version()]
CLUSTER_SCOPED = {"Namespace"}
Obj = dict[str, Any]


# -- rendering ---------------------------------------------------------------------------


def render_kubectl(path: Path) -> list[Obj]:
    out = subprocess.run(["kubectl", "kustomize", str(path)], capture_output=True, text=True,
                         check=True, timeout=120).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def render_subset(path: Path) -> list[Obj]:
    """Kustomize for what these manifests use: resources (files, directories),
    namespace, labels (not into selectors or templates), images, replicas, and JSON 6902
    patches with a kind/name target."""
    k = yaml.safe_load((path / "kustomization.yaml").read_text())
    objs: list[Obj] = []
    for res in k.get("resources", []):
        target = path / res
        if target.is_dir():
            objs += render_subset(target)
        else:
            objs += [d for d in yaml.safe_load_all(target.read_text()) if d]
    for patch in k.get("patches", []):
        ops = yaml.safe_load(patch["patch"])
        for obj in objs:
            if (obj["kind"], obj["metadata"]["name"]) == (patch["target"]["kind"],
                                                          patch["target"]["name"]):
                for op in ops:
                    _json_patch(obj, op)
    for rep in k.get("replicas", []):
        for obj in objs:
            if obj["metadata"]["name"] == rep["name"] and "replicas" in obj.get("spec", {}):
                obj["spec"]["replicas"] = rep["count"]
    for obj in objs:
        if "namespace" in k and obj["kind"] not in CLUSTER_SCOPED:
            obj["metadata"]["namespace"] = k["namespace"]
        for label in k.get("labels", []):
            assert not label.get("includeSelectors") and not label.get("includeTemplates")
            obj["metadata"].setdefault("labels", {}).update(label["pairs"])
        for image in k.get("images", []):
            for c in containers(obj):
                if c["image"].split(":")[0] == image["name"]:
                    c["image"] = f"{image['newName']}:{image['newTag']}"
    return objs


def _json_patch(obj: Obj, op: dict[str, Any]) -> None:
    *parents, last = [p.replace("~1", "/").replace("~0", "~")
                      for p in op["path"].lstrip("/").split("/")]
    node: Any = obj
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    key: Any = int(last) if isinstance(node, list) and last != "-" else last
    if op["op"] == "remove":
        del node[key]
    elif op["op"] == "add" and isinstance(node, list):
        node.insert(len(node) if key == "-" else key, op["value"])
    elif op["op"] in ("add", "replace"):
        node[key] = op["value"]
    else:
        raise AssertionError(f"unsupported patch op {op}")


def render(path: Path) -> list[Obj]:
    return render_kubectl(path) if shutil.which("kubectl") else render_subset(path)


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request) -> tuple[str, list[Obj]]:
    return request.param, render(K8S / "overlays" / request.param)


def find(objs: list[Obj], kind: str, name: str) -> Obj:
    (obj,) = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    return obj


def pod_spec(obj: Obj) -> Obj:
    return obj["spec"]["template"]["spec"]


def containers(obj: Obj) -> Iterator[Obj]:
    template = obj.get("spec", {}).get("template", {}).get("spec", {})
    yield from template.get("containers", [])
    yield from template.get("initContainers", [])


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def named_port(container: Obj, name_or_number: str | int) -> int:
    if isinstance(name_or_number, int):
        return name_or_number
    (port,) = [p["containerPort"] for p in container["ports"] if p["name"] == name_or_number]
    return port


def router_paths() -> set[str]:
    app = build_app(Router(ReplicaPool([]), RouterConfig()))
    return {r.path for r in getattr(app, "app", app).routes}  # the Starlette app behind


def mounts_of_claim(obj: Obj, container: Obj, claim: str) -> list[Obj]:
    volumes = {v["name"] for v in pod_spec(obj)["volumes"]
               if v.get("persistentVolumeClaim", {}).get("claimName") == claim}
    return [m for m in container.get("volumeMounts", []) if m["name"] in volumes]


def under(path: str, mounts: list[Obj]) -> bool:
    return any(path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")
               for m in mounts)


# -- schema ------------------------------------------------------------------------------


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_object_validates_against_the_kubernetes_schema(overlay, version):
    _, objs = overlay
    assert len(objs) >= 12
    for obj in objs:
        kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
@pytest.mark.parametrize("name", OVERLAYS)
def test_the_subset_renderer_renders_what_kubectl_renders(name):
    def key(o: Obj) -> tuple[str, str]:
        return o["kind"], o["metadata"]["name"]

    ours = sorted(render_subset(K8S / "overlays" / name), key=key)
    theirs = sorted(render_kubectl(K8S / "overlays" / name), key=key)
    assert ours == theirs


def test_every_container_requests_resources_and_runs_as_non_root(overlay):
    _, objs = overlay
    for obj in objs:
        for c in containers(obj):
            assert c["resources"]["requests"].get("cpu"), (obj["metadata"]["name"], c["name"])
            assert c["resources"]["requests"].get("memory")
            assert c["resources"]["limits"].get("memory")
            assert pod_spec(obj)["securityContext"]["runAsNonRoot"] is True
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert c["image"] == "registry.example.com/dpserve:0.1.0"


# -- engines -----------------------------------------------------------------------------


def engine_args(engine: Obj) -> list[str]:
    (c,) = pod_spec(engine)["containers"]
    assert c["command"][:2] == ["tini", "--"]
    env = {e["name"]: e.get("value") for e in c.get("env", [])}
    return [env.get(a[2:-1], a) if a.startswith("$(") else a for a in c["args"]]


def test_engines_are_one_vllm_per_gpu_behind_a_headless_service(overlay):
    _, objs = overlay
    engine = find(objs, "StatefulSet", "dpserve-engine")
    (c,) = pod_spec(engine)["containers"]
    assert c["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert c["command"] == ["tini", "--", "python", "-m", "vllm.entrypoints.openai.api_server"]
    assert {"name": "VLLM_SERVER_DEV_MODE", "value": "1"} in c["env"]
    service = find(objs, "Service", engine["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None"
    assert selects(service["spec"]["selector"], engine["spec"]["template"]["metadata"]["labels"])
    assert named_port(c, service["spec"]["ports"][0]["targetPort"]) == \
        service["spec"]["ports"][0]["port"]


def test_the_engine_command_line_parses_with_vllms_parser_and_matches_its_ports(overlay):
    _, objs = overlay
    engine = find(objs, "StatefulSet", "dpserve-engine")
    (c,) = pod_spec(engine)["containers"]
    args = engine_args(engine)
    try:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:  # not every machine has vLLM; the flags are then read by hand
        port = int(args[args.index("--port") + 1])
        host = args[args.index("--host") + 1]
    else:
        ns = make_arg_parser(FlexibleArgumentParser()).parse_args(args)
        validate_parsed_serve_args(ns)
        port, host = ns.port, ns.host
        assert ns.model.startswith("/data/")
    assert host == "0.0.0.0"
    assert named_port(c, "http") == port
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["path"] == "/health"
        assert named_port(c, c[probe]["httpGet"]["port"]) == port
    assert "preStop" in c["lifecycle"]
    assert f"127.0.0.1:{port}/metrics" in " ".join(c["lifecycle"]["preStop"]["exec"]["command"])
    model = args[args.index("--model") + 1]
    assert under(model, mounts_of_claim(engine, c, "dpserve-data"))


def test_engines_may_lose_one_pod_at_a_time_to_disruptions(overlay):
    _, objs = overlay
    pdb = find(objs, "PodDisruptionBudget", "dpserve-engine")
    engine = find(objs, "StatefulSet", "dpserve-engine")
    assert pdb["spec"]["maxUnavailable"] == 1
    assert selects(pdb["spec"]["selector"]["matchLabels"],
                   engine["spec"]["template"]["metadata"]["labels"])


# -- routers -----------------------------------------------------------------------------


def router_ns(objs: list[Obj]) -> tuple[Obj, Obj, Any]:
    router = find(objs, "Deployment", "dpserve-router")
    (c,) = pod_spec(router)["containers"]
    assert "command" not in c  # the image's entrypoint: tini -- dpserve
    return router, c, _parser().parse_args(c["args"])


def test_routers_are_at_least_two_and_find_engines_through_the_headless_service(overlay):
    _, objs = overlay
    router, _, ns = router_ns(objs)
    assert ns.command == "router" and router["spec"]["replicas"] >= 2
    target = parse_target(ns.discover)
    engine = find(objs, "StatefulSet", "dpserve-engine")
    service = find(objs, "Service", target.name)
    assert service["metadata"]["name"] == engine["spec"]["serviceName"]
    assert target.port == service["spec"]["ports"][0]["port"]
    assert ns.route_around_paused is True and ns.replica == []


def test_router_ports_probes_and_service_match_the_router(overlay):
    _, objs = overlay
    router, c, ns = router_ns(objs)
    port = ns.port if ns.port is not None else RouterConfig().port
    assert ns.host == "0.0.0.0" and named_port(c, "http") == port
    paths = router_paths()
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready" in paths
    assert c["livenessProbe"]["httpGet"]["path"] == "/health" in paths
    for probe in ("readinessProbe", "livenessProbe"):
        assert named_port(c, c[probe]["httpGet"]["port"]) == port
    service = find(objs, "Service", "dpserve-router")
    assert selects(service["spec"]["selector"], router["spec"]["template"]["metadata"]["labels"])
    assert named_port(c, service["spec"]["ports"][0]["targetPort"]) == port
    annotations = router["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == port
    assert annotations["prometheus.io/path"] in paths


def writable(mounts: list[Obj]) -> list[Obj]:
    return [m for m in mounts if not m.get("readOnly")]


def env_of(container: Obj) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def covering(path: str, mounts: list[Obj]) -> Obj:
    """The mount `path` lies on (the deepest, as the kernel resolves it)."""
    found = [m for m in mounts if under(path, [m])]
    assert found, f"{path} is on no mount"
    return max(found, key=lambda m: len(m["mountPath"]))


def place(mount: Obj) -> tuple[str, str]:
    """Where a mount shows which part of the volume: (subPath, mountPath)."""
    return mount.get("subPath", ""), mount["mountPath"]


def overlaps(a: str, b: str) -> bool:
    """Whether two subPaths of one volume share files ("" is the whole volume)."""
    a, b = a.strip("/") + "/", b.strip("/") + "/"
    return a == "/" or b == "/" or a.startswith(b) or b.startswith(a)


def finetune_ns(objs: list[Obj]) -> tuple[Obj, Obj, Any]:
    job = find(objs, "Job", "dpserve-finetune")
    (c,) = pod_spec(job)["containers"]
    return job, c, _parser().parse_args(c["args"])


def test_router_keys_are_required_files_from_the_secret_never_env_or_flags(overlay):
    _, objs = overlay
    router, c, ns = router_ns(objs)
    secrets = {v["name"]: v["secret"] for v in pod_spec(router)["volumes"] if "secret" in v}
    key_mounts = [m for m in c["volumeMounts"] if m["name"] in secrets]
    assert key_mounts and all(m.get("readOnly") for m in key_mounts)
    for path in (ns.api_key_file, ns.admin_key_file):
        assert path and under(path, key_mounts), path
        (mount,) = [m for m in key_mounts if under(path, [m])]
        secret = secrets[mount["name"]]
        assert not secret.get("optional")  # no key: the pod does not start
        assert secret["defaultMode"] & 0o007 == 0  # not world-readable
        assert path.rsplit("/", 1)[1] in {i["path"] for i in secret["items"]}
    assert pod_spec(router)["securityContext"]["fsGroup"] == \
        pod_spec(router)["securityContext"]["runAsGroup"]  # 0440: the group reads them


def optional_secret_refs(node: Any, where: str = "") -> Iterator[str]:
    """Where, in an object, a Secret is referred to as optional (a key that may be absent)."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("secret", "secretKeyRef", "secretRef") and isinstance(value, dict) \
                    and value.get("optional"):
                yield f"{where}.{key}"
            yield from optional_secret_refs(value, f"{where}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from optional_secret_refs(value, f"{where}[{i}]")


def test_no_secret_is_optional_and_no_key_is_in_an_environment(overlay):
    _, objs = overlay
    found = [f"{o['kind']}/{o['metadata']['name']}{w}" for o in objs
             for w in optional_secret_refs(o)]
    assert found == []
    assert [o for o in objs if o["kind"] == "Secret"] == []  # keys are made in the cluster
    for obj in objs:
        for c in containers(obj):
            assert not any("secretRef" in e for e in c.get("envFrom", [])), c["name"]
            assert not any("secretKeyRef" in e.get("valueFrom", {}) for e in c.get("env", []))
            assert not {e["name"] for e in c.get("env", [])} & {
                "DPSERVE_API_KEY", "DPSERVE_API_KEYS", "DPSERVE_ADMIN_KEY"}


def test_the_routers_settings_pass_its_own_validation_with_both_keys(overlay, tmp_path):
    """What `dpserve router` does at start-up in the pod, with the Secret's files: it refuses
    to start listening beyond loopback without an admin key, or with a key it rejects."""
    _, objs = overlay
    _, c, ns = router_ns(objs)
    files = {ns.api_key_file: "client-key-" + "0" * 24 + "\n",
             ns.admin_key_file: "admin-key-" + "1" * 32 + "\n"}
    flags = _flags(ns)
    for name, path in (("api_key_file", ns.api_key_file), ("admin_key_file", ns.admin_key_file)):
        local = tmp_path / Path(path).name
        local.write_text(files[path])
        flags[name] = str(local)
    cfg = build_router_config(flags, {}, env_of(c))
    assert cfg.api_keys == [files[ns.api_key_file].strip()]
    assert cfg.admin_key == files[ns.admin_key_file].strip()
    assert not cfg.insecure_admin


def test_the_admin_api_listens_on_the_pods_loopback_only(overlay, monkeypatch):
    _, objs = overlay
    _, c, ns = router_ns(objs)
    assert ns.admin_port is not None and ns.admin_port != ns.port
    assert is_loopback_host(ns.admin_host or RouterConfig().admin_host)
    assert ns.admin_port not in {p["containerPort"] for p in c["ports"]}
    service = find(objs, "Service", "dpserve-router")
    assert all(named_port(c, p["targetPort"]) != ns.admin_port for p in service["spec"]["ports"])
    # `kubectl exec deploy/dpserve-router -- dpserve deploy|status ...` (deploy/README.md)
    # reaches that listener with no --router flag.
    monkeypatch.setenv("DPSERVE_ROUTER_URL", env_of(c)["DPSERVE_ROUTER_URL"])
    for command in (["deploy", "/data/runs/ft/step-000200"], ["status"]):
        url = _parser().parse_args(command).router
        assert url == f"http://127.0.0.1:{ns.admin_port}", command


# -- pod security ------------------------------------------------------------------------


WORKLOADS = (("StatefulSet", "dpserve-engine"), ("Deployment", "dpserve-router"),
             ("Job", "dpserve-finetune"))
READ_ONLY_ROOT_EXCEPTIONS: dict[str, str] = {}
"""`pod/container` -> why it must write its root filesystem. None today: every write goes
to an emptyDir (HOME, caches, /tmp, /dev/shm) or to the container's part of the volume."""
SCRATCH_ENV = re.compile(r"^(HOME|TMPDIR|HF_HOME|XDG_\w+|\w*CACHE\w*|\w*CONFIG_ROOT)$")
"""Variables naming where a program writes its caches and settings."""


def pod_templates(objs: list[Obj]) -> list[tuple[str, Obj]]:
    """(name, pod spec) of every pod the manifests make, whatever makes it."""
    found = []
    for obj in objs:
        spec = obj.get("spec", {})
        if obj["kind"] == "Pod":
            found.append((obj["metadata"]["name"], spec))
        elif obj["kind"] == "CronJob":
            found.append((obj["metadata"]["name"], spec["jobTemplate"]["spec"]["template"]["spec"]))
        elif "template" in spec:
            found.append((obj["metadata"]["name"], spec["template"]["spec"]))
    return found


def all_containers(spec: Obj) -> list[Obj]:
    return [*spec.get("initContainers", []), *spec["containers"],
            *spec.get("ephemeralContainers", [])]


def test_every_pod_runs_confined(overlay):
    _, objs = overlay
    pods = pod_templates(objs)
    assert {name for _, name in WORKLOADS} <= {name for name, _ in pods}
    for name, spec in pods:
        psc = spec["securityContext"]
        assert psc["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert spec["automountServiceAccountToken"] is False, name  # none calls the API
        assert psc["runAsNonRoot"] is True and psc.get("runAsUser") != 0, name
        assert not any(spec.get(f) for f in ("hostNetwork", "hostPID", "hostIPC")), name
        assert not any("hostPath" in v for v in spec.get("volumes", [])), name
        for c in all_containers(spec):
            where = f"{name}/{c['name']}"
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, where
            assert sc.get("privileged") is not True, where
            assert sc["capabilities"]["drop"] == ["ALL"], where
            assert not sc["capabilities"].get("add"), where
            # A container may not loosen what its pod sets.
            assert sc.get("seccompProfile", psc["seccompProfile"]) == psc["seccompProfile"]
            assert sc.get("runAsNonRoot", True) is True and sc.get("runAsUser") != 0, where
            assert sc["readOnlyRootFilesystem"] is (where not in READ_ONLY_ROOT_EXCEPTIONS), where
            assert not any("hostPort" in p for p in c.get("ports", [])), where


def test_what_containers_write_goes_to_bounded_emptydirs(overlay):
    _, objs = overlay
    for name, spec in pod_templates(objs):
        empty = {v["name"]: v["emptyDir"] for v in spec["volumes"] if "emptyDir" in v}
        for c in all_containers(spec):
            where = f"{name}/{c['name']}"
            scratch = [m for m in c["volumeMounts"] if m["name"] in empty and not m.get("readOnly")]
            assert any(m["mountPath"] == "/tmp" for m in scratch), where
            # A runaway cache evicts the pod rather than filling the node's disk or memory.
            assert all(empty[m["name"]].get("sizeLimit") for m in scratch), where
            env = env_of(c)
            assert "HOME" in env, where  # the image's HOME is on the read-only root
            for var, value in env.items():
                if SCRATCH_ENV.match(var):
                    assert under(value, scratch), (where, var, value)
            if "nvidia.com/gpu" in c["resources"]["limits"]:  # they compile kernels
                assert {"XDG_CACHE_HOME", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"} <= set(env)
    (engine,) = pod_spec(find(objs, "StatefulSet", "dpserve-engine"))["containers"]
    assert {"VLLM_CACHE_ROOT", "VLLM_CONFIG_ROOT"} <= set(env_of(engine))


# -- network policy ----------------------------------------------------------------------
# A small reading of NetworkPolicy as a CNI enforces it, so the tests ask "may this pod
# open that port on that one?" rather than how the rules happen to be spelled.

NS_LABEL = "kubernetes.io/metadata.name"  # every namespace carries its name as this label


@dataclasses.dataclass
class Peer:
    """One end of a connection: a pod (its namespace's labels, its labels, its named
    ports), or an address that is no pod (`labels` None), e.g. outside the cluster."""

    namespace: dict[str, str]
    labels: dict[str, str] | None
    ports: dict[str, int] = dataclasses.field(default_factory=dict)


def policies(objs: list[Obj]) -> list[Obj]:
    return [o for o in objs if o["kind"] == "NetworkPolicy"]


def matches(selector: Obj, labels: dict[str, str]) -> bool:
    """A label selector: matchLabels and matchExpressions, every operator; {} matches all."""
    if not selects(selector.get("matchLabels", {}), labels):
        return False
    for e in selector.get("matchExpressions", []):
        key, values = e["key"], e.get("values", [])
        ok = {"In": key in labels and labels[key] in values,
              "NotIn": labels.get(key) not in values,
              "Exists": key in labels,
              "DoesNotExist": key not in labels}[e["operator"]]
        if not ok:
            return False
    return True


def policy_types(policy: Obj) -> list[str]:
    spec = policy["spec"]
    return spec.get("policyTypes") or ["Ingress", *(["Egress"] if "egress" in spec else [])]


def _peer_matches(peer: Obj, other: Peer, namespace: str) -> bool:
    if "ipBlock" in peer:
        return True  # read generously: a block may hold any address, pods' included
    if other.labels is None:
        return False
    ns_selector = peer.get("namespaceSelector")
    in_namespace = (other.namespace.get(NS_LABEL) == namespace if ns_selector is None
                    else matches(ns_selector, other.namespace))
    return in_namespace and matches(peer.get("podSelector", {}), other.labels)


def _port_matches(rule: Obj, port: int, protocol: str, dst: Peer) -> bool:
    for p in rule.get("ports") or [{}]:  # no ports: every port
        if p and p.get("protocol", "TCP") != protocol:
            continue
        want = p.get("port")
        if want is None:
            return True
        if isinstance(want, str):  # a named port of the destination's containers
            if want not in dst.ports:
                continue
            want = dst.ports[want]
        if want <= port <= p.get("endPort", want):
            return True
    return False


def _admits(objs: list[Obj], pod: Peer, other: Peer, direction: str, port: int,
            protocol: str, dst: Peer) -> bool:
    """Whether the policies of `pod`'s namespace let it accept from (Ingress) or open to
    (Egress) `other`. A pod no policy of that direction selects is not isolated."""
    if pod.labels is None:
        return True
    namespace = pod.namespace.get(NS_LABEL)
    selecting = [p for p in policies(objs) if p["metadata"].get("namespace") == namespace
                 and direction in policy_types(p) and matches(p["spec"]["podSelector"], pod.labels)]
    if not selecting:
        return True
    rules_key, peers_key = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
    return any((not rule.get(peers_key)
                or any(_peer_matches(peer, other, namespace) for peer in rule[peers_key]))
               and _port_matches(rule, port, protocol, dst)
               for p in selecting for rule in p["spec"].get(rules_key, []))


def may_connect(objs: list[Obj], src: Peer, dst: Peer, port: int, protocol: str = "TCP") -> bool:
    return (_admits(objs, src, dst, "Egress", port, protocol, dst)
            and _admits(objs, dst, src, "Ingress", port, protocol, dst))


def accepts(objs: list[Obj], dst: Peer, src: Peer, port: int, protocol: str = "TCP") -> bool:
    """Whether `dst`'s own ingress rules admit `src`, whatever `src`'s egress allows (a pod
    added later, or one in a namespace without policies, may have open egress)."""
    return _admits(objs, dst, src, "Ingress", port, protocol, dst)


def cluster(objs: list[Obj]) -> dict[str, Peer]:
    """The namespace's pods by component, and what else a cluster holds around them."""
    peers: dict[str, Peer] = {}
    namespace = ""
    for obj in objs:
        if obj["kind"] in ("StatefulSet", "Deployment", "Job"):
            template = obj["spec"]["template"]
            labels = template["metadata"]["labels"]
            namespace = obj["metadata"]["namespace"]
            ports = {p["name"]: p["containerPort"] for c in template["spec"]["containers"]
                     for p in c.get("ports", []) if "name" in p}
            peers[labels["app.kubernetes.io/component"]] = Peer({NS_LABEL: namespace}, labels,
                                                                ports)
    assert set(peers) == {"engine", "router", "finetune"}
    peers["stranger"] = Peer({NS_LABEL: namespace}, {"app": "debug-shell"})  # same namespace
    peers["client"] = Peer({NS_LABEL: "apps"}, {"app": "chat"})
    peers["prometheus"] = Peer({NS_LABEL: "monitoring"}, {"app.kubernetes.io/name": "prometheus"})
    peers["kube-dns"] = Peer({NS_LABEL: "kube-system"}, {"k8s-app": "kube-dns"})
    peers["outside"] = Peer({}, None)
    return peers


def test_the_policy_reading_agrees_with_kubernetes_semantics():
    def policy(name: str, spec: Obj) -> Obj:
        return {"kind": "NetworkPolicy", "metadata": {"name": name, "namespace": "t"},
                "spec": spec}

    a = Peer({NS_LABEL: "t"}, {"role": "a"}, {"web": 80})
    b = Peer({NS_LABEL: "t"}, {"role": "b"}, {"web": 80})
    elsewhere = Peer({NS_LABEL: "x"}, {"role": "a"})
    assert may_connect([], a, b, 80)  # no policy: nothing is isolated
    deny = policy("deny", {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]})
    assert not may_connect([deny], a, b, 80)
    to_b = policy("to-b", {"podSelector": {"matchLabels": {"role": "b"}}, "ingress": [
        {"from": [{"podSelector": {"matchLabels": {"role": "a"}}}], "ports": [{"port": "web"}]}]})
    out = policy("out", {"podSelector": {"matchExpressions": [
        {"key": "role", "operator": "NotIn", "values": ["b"]}]}, "policyTypes": ["Egress"],
        "egress": [{}]})
    objs = [deny, to_b, out]
    assert policy_types(to_b) == ["Ingress"]
    assert may_connect(objs, a, b, 80)  # named port, pod selector, an empty egress rule
    assert not may_connect(objs, a, b, 81)
    assert not may_connect(objs, a, b, 80, "UDP")
    assert not may_connect(objs, elsewhere, b, 80)  # a podSelector alone: its own namespace
    assert not may_connect(objs, b, a, 80)  # b's egress is still denied
    anywhere = policy("any", {"podSelector": {}, "ingress": [
        {"from": [{"ipBlock": {"cidr": "10.0.0.0/8"}}]}]})
    assert may_connect([anywhere], Peer({}, None), b, 80)
    assert may_connect([anywhere], elsewhere, b, 80)  # pods' addresses may be in the block


def test_a_default_deny_policy_covers_every_pod_both_ways(overlay):
    _, objs = overlay
    deny = [p for p in policies(objs) if p["spec"]["podSelector"] == {}]
    assert len(deny) == 1
    assert sorted(deny[0]["spec"]["policyTypes"]) == ["Egress", "Ingress"]
    assert "ingress" not in deny[0]["spec"] and "egress" not in deny[0]["spec"]
    # A pod nobody wrote a rule for (a debug shell) can neither be reached nor reach out.
    peers = cluster(objs)
    stranger = peers.pop("stranger")
    for name, other in peers.items():
        for port, protocol in ((8000, "TCP"), (29400, "TCP"), (53, "UDP"), (443, "TCP")):
            assert not may_connect(objs, other, stranger, port, protocol), (name, port)
            assert not may_connect(objs, stranger, other, port, protocol), (name, port)


def test_clients_and_prometheus_reach_the_routers_api_port_and_no_other(overlay):
    _, objs = overlay
    peers = cluster(objs)
    router, c, ns = router_ns(objs)
    port = named_port(c, "http")
    scraped = int(router["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"])
    assert scraped == port  # prometheus.yaml scrapes /metrics there (the pods' `http` port)
    for name in ("client", "prometheus", "outside"):
        assert may_connect(objs, peers[name], peers["router"], port), name
        for other in (ns.admin_port, 8080, 9090):
            assert not may_connect(objs, peers[name], peers["router"], other), (name, other)


def test_only_router_pods_may_reach_the_engines(overlay):
    _, objs = overlay
    peers = cluster(objs)
    port = peers["engine"].ports["http"]
    assert may_connect(objs, peers["router"], peers["engine"], port)
    for name, src in peers.items():
        for p in (port, 8001, 29400):
            if (name, p) != ("router", port):
                assert not accepts(objs, peers["engine"], src, p), (name, p)


def test_engines_reach_nothing(overlay):
    _, objs = overlay
    peers = cluster(objs)
    engine = peers.pop("engine")
    for name, dst in [*peers.items(), ("another engine", engine)]:
        for port, protocol in ((8000, "TCP"), (29400, "TCP"), (53, "UDP"), (53, "TCP"),
                               (443, "TCP")):
            assert not may_connect(objs, engine, dst, port, protocol), (name, port, protocol)


def test_the_rendezvous_port_is_reachable_from_fine_tune_pods_only(overlay):
    _, objs = overlay
    peers = cluster(objs)
    finetune = peers["finetune"]
    _, c, _ = finetune_ns(objs)
    rdzv = named_port(c, "rdzv")
    assert rdzv == 29400
    # The rendezvous, and NCCL/Gloo on ports of their own choosing, among themselves ...
    for port in (rdzv, 45678):
        assert may_connect(objs, finetune, finetune, port)
        # ... and from nobody else.
        for name, src in peers.items():
            if name != "finetune":
                assert not accepts(objs, finetune, src, port), (name, port)


def test_routers_and_fine_tune_pods_resolve_names_and_reach_nothing_else(overlay):
    _, objs = overlay
    peers = cluster(objs)
    engine_port = peers["engine"].ports["http"]
    for name in ("router", "finetune"):
        for protocol in ("UDP", "TCP"):
            assert may_connect(objs, peers[name], peers["kube-dns"], 53, protocol), name
        assert not may_connect(objs, peers[name], peers["kube-dns"], 443), name
        for dst in ("engine", "router", "finetune", "stranger", "client", "prometheus",
                    "outside"):
            for port in (8000, 29400, 45678, 443):
                expected = ((name, dst) == ("finetune", "finetune")  # any port: collectives
                            or (name, dst, port) == ("router", "engine", engine_port))
                assert may_connect(objs, peers[name], peers[dst], port) is expected, (name, dst,
                                                                                      port)


# -- storage -----------------------------------------------------------------------------


def test_routers_write_only_the_lock_the_link_and_the_snapshots(overlay):
    _, objs = overlay
    router, c, ns = router_ns(objs)
    mounts = mounts_of_claim(router, c, "dpserve-data")
    (rw,) = writable(mounts)  # one writable part of the volume, every other read-only
    for path in (ns.deploy_lock, ns.deployed_link, ns.snapshot_dir):
        assert under(path, [rw]), path
    assert under(ns.base_model, mounts) and under(ns.checkpoint_root, mounts)
    assert not under(ns.checkpoint_root, [rw])  # checkpoints: read, copied, never written
    # ... and nobody else writes that part: what engines load is what a router checked.
    for kind, name in WORKLOADS:
        obj = find(objs, kind, name)
        if obj is not router:
            for other in containers(obj):
                for m in writable(mounts_of_claim(obj, other, "dpserve-data")):
                    assert not overlaps(m.get("subPath", ""), rw.get("subPath", "")), name
    assert ns.graceful_shutdown_s < pod_spec(router)["terminationGracePeriodSeconds"]


def test_engines_read_the_serving_area_at_the_paths_the_router_writes_it(overlay):
    """The deployed link holds an absolute path (the base model at first, then a snapshot):
    it must name the same files in an engine pod as in the router that wrote it."""
    _, objs = overlay
    router, rc, ns = router_ns(objs)
    engine = find(objs, "StatefulSet", "dpserve-engine")
    (ec,) = pod_spec(engine)["containers"]
    _, _, ft = finetune_ns(objs)
    router_mounts = mounts_of_claim(router, rc, "dpserve-data")
    engine_mounts = mounts_of_claim(engine, ec, "dpserve-data")
    model = engine_args(engine)[engine_args(engine).index("--model") + 1]
    assert model == ns.deployed_link == ns.base_model  # restarted engines load the deployed
    for path in (ns.snapshot_dir, ns.deployed_link, ft.model):  # ft.model: the link's first
        assert place(covering(path, engine_mounts)) == place(covering(path, router_mounts)), path
    assert writable(engine_mounts) == []
    (volume,) = [v for v in pod_spec(engine)["volumes"] if v["name"] == engine_mounts[0]["name"]]
    assert volume["persistentVolumeClaim"]["readOnly"] is True
    # Engines see nothing they do not load: not the checkpoints, not the training data.
    assert {place(m) for m in engine_mounts} <= {place(m) for m in router_mounts}
    assert not any(under(ns.checkpoint_root, [m]) for m in engine_mounts)


def test_routers_read_the_checkpoints_where_the_fine_tune_writes_them(overlay):
    _, objs = overlay
    router, rc, ns = router_ns(objs)
    job, fc, ft = finetune_ns(objs)
    assert Path(ft.output).is_relative_to(ns.checkpoint_root)  # deploys accept them
    job_mounts = mounts_of_claim(job, fc, "dpserve-data")
    (rw,) = writable(job_mounts)  # the Job writes its outputs and nothing else
    assert under(ft.output, [rw]) and not under(ft.model, [rw]) and not under(ft.data, [rw])
    router_side = covering(ns.checkpoint_root, mounts_of_claim(router, rc, "dpserve-data"))
    assert place(router_side) == place(rw) and router_side.get("readOnly") is True


def test_trainer_engines_and_routers_share_one_checkpoint_volume(overlay):
    name, objs = overlay
    pvc = find(objs, "PersistentVolumeClaim", "dpserve-data")
    assert pvc["spec"]["accessModes"] == (
        ["ReadWriteOnce"] if name == "single-node" else ["ReadWriteMany"])
    for kind, obj_name in (("StatefulSet", "dpserve-engine"), ("Deployment", "dpserve-router"),
                           ("Job", "dpserve-finetune")):
        obj = find(objs, kind, obj_name)
        (c,) = pod_spec(obj)["containers"]
        assert mounts_of_claim(obj, c, "dpserve-data"), obj_name


def test_the_base_declares_a_read_write_many_volume():
    base = render(K8S / "base")
    assert find(base, "PersistentVolumeClaim", "dpserve-data")["spec"]["accessModes"] == [
        "ReadWriteMany"]


# -- fine-tuning -------------------------------------------------------------------------


def test_the_finetune_job_meets_by_c10d_rendezvous_on_pod_0(overlay, tmp_path):
    name, objs = overlay
    job = find(objs, "Job", "dpserve-finetune")
    (c,) = pod_spec(job)["containers"]
    ns = _parser().parse_args(c["args"])
    assert ns.command == "finetune"
    # dpserve validates the settings as it would in the pod, with the volume at tmp_path.
    (tmp_path / "datasets").mkdir()
    (tmp_path / "datasets" / "train.jsonl").write_text('{"text": "hi"}\n')
    local = argparse.Namespace(**{
        k: v.replace("/data/", f"{tmp_path}/", 1) if isinstance(v, str) else v
        for k, v in vars(ns).items()})
    cfg = build_finetune_config(local, env={})
    cfg = dataclasses.replace(cfg, model=ns.model, data=ns.data, output=ns.output)
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["suspend"] is True
    assert spec["completions"] == spec["parallelism"] == cfg.nnodes
    assert c["resources"]["requests"]["nvidia.com/gpu"] == cfg.nproc_per_node
    assert c["resources"]["limits"]["nvidia.com/gpu"] == cfg.nproc_per_node
    mounts = mounts_of_claim(job, c, "dpserve-data")
    for path in (cfg.model, cfg.data, cfg.output):
        assert under(str(path), mounts)
    if cfg.nnodes == 1:
        assert name == "single-node" and cfg.rdzv_endpoint is None
        return
    host, port = cfg.rdzv_endpoint.rsplit(":", 1)
    subdomain = pod_spec(job)["subdomain"]
    assert host == f"{job['metadata']['name']}-0.{subdomain}"  # Indexed Job pod 0's name
    service = find(objs, "Service", subdomain)
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert selects(service["spec"]["selector"], job["spec"]["template"]["metadata"]["labels"])
    assert named_port(c, "rdzv") == int(port)


# -- monitoring --------------------------------------------------------------------------


def test_prometheus_scrapes_router_metrics_and_engine_metrics_through_the_router(overlay):
    _, objs = overlay
    config = yaml.safe_load(find(objs, "ConfigMap", "dpserve-prometheus-scrape")["data"][
        "scrape-configs.yml"])
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    paths = router_paths()
    assert {j["metrics_path"] for j in jobs.values()} == {"/metrics", "/metrics/engines"}
    assert all(j["metrics_path"] in paths for j in jobs.values())
    (target,) = jobs["dpserve-engines"]["static_configs"][0]["targets"]
    service = find(objs, "Service", "dpserve-router")
    assert target == f"dpserve-router.{service['metadata']['namespace']}.svc:" \
                     f"{service['spec']['ports'][0]['port']}"
    assert not re.search(r"dpserve-engine[.:]", str(config))  # only routers reach engines


def test_routers_keep_one_pod_through_disruptions(overlay):
    _, objs = overlay
    pdb = find(objs, "PodDisruptionBudget", "dpserve-router")
    router = find(objs, "Deployment", "dpserve-router")
    assert pdb["spec"]["minAvailable"] == 1 < router["spec"]["replicas"]
    assert selects(pdb["spec"]["selector"]["matchLabels"],
                   router["spec"]["template"]["metadata"]["labels"])


def test_rendering_does_not_touch_the_sources():
    before = {p: p.read_bytes() for p in K8S.rglob("*.yaml")}
    copy.deepcopy(render_subset(K8S / "overlays" / "multi-node"))
    assert before == {p: p.read_bytes() for p in K8S.rglob("*.yaml")}


def test_the_scrape_configuration_passes_promtool(tmp_path):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian package `prometheus`)")
    objs = render(K8S / "overlays" / "multi-node")
    scrape = yaml.safe_load(find(objs, "ConfigMap", "dpserve-prometheus-scrape")["data"][
        "scrape-configs.yml"])

    def check(scrape: Obj) -> subprocess.CompletedProcess[str]:
        config = tmp_path / "prometheus.yml"
        config.write_text(yaml.safe_dump({"global": {"scrape_interval": "15s"}, **scrape}))
        return subprocess.run([promtool, "check", "config", str(config)], capture_output=True,
                              text=True, timeout=60, check=False)

    done = check(scrape)
    if "field kubernetes_sd_configs not found" in done.stdout + done.stderr:
        # Debian's build leaves Kubernetes discovery out: check everything else (the
        # relabelling included) with a static target in its place.
        for job in scrape["scrape_configs"]:
            if job.pop("kubernetes_sd_configs", None) is not None:
                job["static_configs"] = [{"targets": ["router.example:8000"]}]
        done = check(scrape)
    assert done.returncode == 0, done.stdout + done.stderr


class _FakeEngineMetrics(http.server.BaseHTTPRequestHandler):
    """A fake engine's /metrics in vLLM's text format: busy for the first `busy` scrapes."""

    busy = 2
    scrapes = 0

    def do_GET(self) -> None:
        cls = type(self)
        cls.scrapes += 1
        running = 1 if cls.scrapes <= cls.busy else 0
        body = ("# TYPE vllm:num_requests_running gauge\n"
                f'vllm:num_requests_running{{engine="0",model_name="model"}} {running}.0\n'
                'vllm:num_requests_waiting{engine="0",model_name="model"} 0.0\n').encode()
        self.send_response(200)
        self.send_header("content-type", "text/plain; version=0.0.4")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_the_engines_prestop_hook_waits_until_vllm_has_nothing_running(tmp_path):
    engine = find(render(K8S / "base"), "StatefulSet", "dpserve-engine")
    (c,) = pod_spec(engine)["containers"]
    command = c["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:2] == ["python", "-c"]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeEngineMetrics)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        script = command[2].replace("127.0.0.1:8000", f"127.0.0.1:{server.server_port}")
        env = {"PATH": os.environ["PATH"], "DRAIN_DELAY_S": "0"}
        done = subprocess.run([sys.executable, "-c", script], env=env, timeout=60,
                              capture_output=True, text=True, check=False)
    finally:
        server.shutdown()
    assert done.returncode == 0, done.stderr
    assert _FakeEngineMetrics.scrapes == _FakeEngineMetrics.busy + 1  # left once idle
    # An engine that already stopped answering ends the wait at once.
    done = subprocess.run([sys.executable, "-c", script], env=env, timeout=30,
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
