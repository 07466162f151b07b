"""What the Kubernetes manifest tests share: rendering the overlays (with `kubectl
kustomize` where kubectl is installed; elsewhere a small renderer for the subset of
Kustomize these manifests use, `render_subset`, checked to render exactly what kubectl
renders wherever both are present), finding objects, reading pods, mounts and the
router's command line, and a reading of NetworkPolicy as a CNI enforces it."""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import yaml

from dpserve.cli import _parser
from dpserve.config import RouterConfig
from dpserve.router.fleet.pool import ReplicaPool
from dpserve.router.http.app import Router, build_app

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


# -- routers -----------------------------------------------------------------------------


def router_ns(objs: list[Obj]) -> tuple[Obj, Obj, Any]:
    router = find(objs, "Deployment", "dpserve-router")
    (c,) = pod_spec(router)["containers"]
    assert "command" not in c  # the image's entrypoint: tini -- dpserve
    return router, c, _parser().parse_args(c["args"])


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
