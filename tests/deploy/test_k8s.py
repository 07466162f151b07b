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
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from dpserve.cli import _parser
from dpserve.config import RouterConfig, parse_target
from dpserve.finetune.config import build_finetune_config
from tests.deploy.k8s import (
    K8S,
    KUBERNETES_VERSIONS,
    OVERLAYS,
    WORKLOADS,
    Obj,
    containers,
    covering,
    find,
    finetune_ns,
    mounts_of_claim,
    named_port,
    overlaps,
    place,
    pod_spec,
    render,
    render_kubectl,
    render_subset,
    router_ns,
    router_paths,
    selects,
    under,
    writable,
)

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
