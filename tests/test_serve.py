"""`dpserve.serve`, the composition root: listening sockets, the server's settings, and
the router wired to its rolling deploy."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from dpserve.config import RouterConfig
from dpserve.replicas.launcher import free_port
from dpserve.rollout.deployed import Deployed, Weights
from dpserve.router.pool import Replica, ReplicaPool
from dpserve.serve import PortInUseError, bind_socket, compose, listen, uvicorn_server
from tests.rollout.checkpoints import write_adapter


def test_a_busy_port_is_a_clear_error_naming_the_address():
    taken = bind_socket("127.0.0.1", 0)
    port = taken.getsockname()[1]
    taken.listen()
    try:
        with pytest.raises(PortInUseError, match=f"cannot listen on 127.0.0.1:{port}"):
            bind_socket("127.0.0.1", port)
    finally:
        taken.close()


def test_the_admin_listener_is_a_second_socket_and_a_busy_one_frees_the_first():
    api, admin = free_port(), free_port()
    sockets = listen(RouterConfig(port=api, admin_port=admin))
    try:
        assert [s.getsockname()[1] for s in sockets] == [api, admin]
        assert sockets[1].getsockname()[0] == "127.0.0.1"  # loopback by default
    finally:
        for s in sockets:
            s.close()
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", admin))
    try:
        with pytest.raises(PortInUseError):
            listen(RouterConfig(port=api, admin_port=admin))
        bind_socket("127.0.0.1", api).close()  # the API port was given back
    finally:
        blocker.close()


def test_the_server_trusts_no_proxy_headers_unless_told_and_keeps_its_limits():
    router, _ = compose(ReplicaPool([]), None, RouterConfig())
    plain = uvicorn_server(router, RouterConfig()).config
    trusting = uvicorn_server(router, RouterConfig(trusted_proxies=["10.0.0.0/8"],
                                                   keep_alive_timeout_s=7)).config
    assert plain.proxy_headers is False
    assert trusting.proxy_headers is True and trusting.forwarded_allow_ips == ["10.0.0.0/8"]
    assert trusting.timeout_keep_alive == 7


def test_compose_gives_the_router_its_deploy_routes_and_the_deploys_pause_test():
    pool = ReplicaPool([Replica(id="r0", url="http://r0")])
    deployed = Deployed(Weights("/models/m", "base:m"))
    router, rollout = compose(pool, deployed, RouterConfig())
    assert {r.path for r in router.routes} == {"/admin/deploy", "/admin/deploy/{deploy_id}"}
    assert router.metrics is not None
    replica = pool.get("r0")
    assert replica is not None and not rollout.hot_loading(replica)
    assert rollout.deployed_version() == "base:m"


@pytest.mark.parametrize("case", ["missing", "other base", "base name"])
def test_a_bad_start_adapter_is_one_line_before_any_replica_starts(tiny_model, tmp_path, case):
    adapter, _ = write_adapter(tiny_model, tmp_path / "lora", extra={
        "base_fingerprint": "0" * 64 if case == "other base" else None})
    name, path = {"missing": ("support", tmp_path / "nowhere"),
                  "other base": ("support", adapter),
                  "base name": ("tiny", adapter)}[case]
    done = subprocess.run(
        [sys.executable, "-m", "dpserve", "serve", "--model", str(tiny_model),
         "--served-model-name", "tiny", "--port", str(free_port()),
         "--run-dir", str(tmp_path / "runs"), "--checkpoint-root", str(tmp_path),
         "--enable-lora", "--lora", f"{name}={path}"],
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and f"--lora {name}={path}: refused" in errors[0], done.stderr
    assert "Traceback" not in done.stderr
    assert not list((tmp_path / "runs").glob("*/replica-*.log"))  # no engine was started
