"""The Kubernetes manifests' confinement: keys only as required files, the admin API on
the router pod's loopback, every pod confined (seccomp, no token, no escalation, no
capabilities, read-only root, writes only to bounded emptyDirs and its part of the
volume), and the NetworkPolicies, read as a CNI applies them, allowing exactly the
connections dpserve needs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dpserve.cli import _flags, _parser
from dpserve.config import RouterConfig, build_router_config, is_loopback_host
from tests.deploy.k8s import (
    NS_LABEL,
    READ_ONLY_ROOT_EXCEPTIONS,
    SCRATCH_ENV,
    WORKLOADS,
    Obj,
    Peer,
    accepts,
    all_containers,
    cluster,
    containers,
    env_of,
    find,
    finetune_ns,
    may_connect,
    named_port,
    pod_spec,
    pod_templates,
    policies,
    policy_types,
    router_ns,
    under,
)

# -- keys and the admin API --------------------------------------------------------------


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


def test_the_routers_settings_pass_its_own_validation_with_all_keys(overlay, tmp_path):
    """What `dpserve router` does at start-up in the pod, with the Secret's files: it refuses
    to start listening beyond loopback without an admin key, or with a key it rejects,
    or to talk to its peers without their key."""
    _, objs = overlay
    _, c, ns = router_ns(objs)
    files = {ns.api_key_file: "client-key-" + "0" * 24 + "\n",
             ns.admin_key_file: "admin-key-" + "1" * 32 + "\n",
             ns.peer_key_file: "peer-key-" + "2" * 48 + "\n"}
    flags = _flags(ns)
    for name, path in (("api_key_file", ns.api_key_file), ("admin_key_file", ns.admin_key_file),
                       ("peer_key_file", ns.peer_key_file)):
        local = tmp_path / Path(path).name
        local.write_text(files[path])
        flags[name] = str(local)
    cfg = build_router_config(flags, {}, env_of(c))
    assert cfg.api_keys == [files[ns.api_key_file].strip()]
    assert cfg.admin_key == files[ns.admin_key_file].strip()
    assert cfg.peer_key == files[ns.peer_key_file].strip()
    assert cfg.peers == ["dpserve-router-peers:5560"]
    assert not cfg.insecure_admin


def test_the_peer_port_is_open_to_router_pods_only(overlay):
    """The routers' reports to each other are signed, not encrypted: the port is theirs."""
    _, objs = overlay
    _, c, ns = router_ns(objs)
    port = int(ns.peer_bind.rsplit(":", 1)[1])
    assert named_port(c, "peers") == port
    rules = [rule for rule in find(objs, "NetworkPolicy", "dpserve-router-ingress")["spec"][
        "ingress"] if any(p["port"] == port for p in rule.get("ports", []))]
    assert rules and all(rule.get("from") == [{"podSelector": {"matchLabels": {
        "app.kubernetes.io/name": "dpserve", "app.kubernetes.io/component": "router"}}}]
        for rule in rules)
    peers = find(objs, "Service", "dpserve-router-peers")["spec"]
    assert peers["clusterIP"] == "None"  # headless: the name resolves to every router pod
    assert ns.peers == [f"dpserve-router-peers:{port}"]


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
