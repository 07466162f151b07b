"""`dpserve.serve`, the composition root: listening sockets, the server's settings, and
the router wired to its rolling deploy."""

from __future__ import annotations

import logging
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from dpserve.config import RouterConfig
from dpserve.replicas.launcher import free_port
from dpserve.rollout.deployed import Deployed, Weights
from dpserve.router.fleet.pool import Replica, ReplicaPool, ReplicaState
from dpserve.router.http.server import PortInUseError, bind_socket, listen, uvicorn_server
from dpserve.serve import announce_ready, compose
from tests.procs import process_alive
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


# `dpserve serve` with tests/fake_vllm_server.py (a fake: starts in a second, where vLLM
# takes a minute) in place of vLLM's API server module.
_SERVE_WITH_FAKE_ENGINES = """
import sys
import dpserve.replicas.launcher as launcher
from dpserve.cli import main
launcher.VLLM_ENTRY = (sys.argv[1],)
sys.exit(main(sys.argv[2:]))
"""
FAKE_ENGINE = str(Path(__file__).parent / "fake_vllm_server.py")


def _serve_with_fake_engines(tmp_path: Path, *flags: str) -> subprocess.Popen[str]:
    """`dpserve serve` of 2 fake engines on a free port, in a session of its own."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    return subprocess.Popen(
        [sys.executable, "-c", _SERVE_WITH_FAKE_ENGINES, FAKE_ENGINE, "serve",
         "--model", str(model), "--served-model-name", "fake-model", "--replicas", "2",
         "--port", "0", *flags, "--run-dir", str(tmp_path / "runs")],
        stderr=subprocess.PIPE, text=True, start_new_session=True)


def test_serve_says_where_the_router_listens_and_when_every_replica_is_ready(tmp_path):
    proc = _serve_with_fake_engines(tmp_path)
    try:
        lines = _lines_until(proc, re.compile(r"2/2 replicas ready after"), within_s=120)
        (where,) = [ln for ln in lines if "router on http://" in ln]
        url = re.search(r"router on (http://127\.0\.0\.1:(\d+)) \(OpenAI API at /v1\)$", where)
        assert url is not None and url.group(2) != "0", where  # the port it really got
        assert httpx.get(url.group(1) + "/v1/models", timeout=5).status_code == 200
        assert lines.index(where) < len(lines) - 1  # said before the replicas were ready
        assert re.search(r"INFO +dpserve\.serve: 2/2 replicas ready after \d+ s$", lines[-1])
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_serve_with_two_workers_answers_on_one_port_and_stops_them_all(tmp_path):
    proc = _serve_with_fake_engines(tmp_path, "--workers", "2")
    try:
        lines = _lines_until(proc, re.compile(r"2/2 replicas ready after"), within_s=120)
        (where,) = [ln for ln in lines if "router on http://" in ln]  # said once, by the leader
        url = where.split("router on ")[1].split()[0]
        followers = [pid for pid in _children(proc.pid)
                     if "dpserve.worker" in _cmdline(pid)]
        assert len(followers) == 1
        for _ in range(20):  # a connection each: some reach the follower
            with httpx.Client() as client:
                assert client.get(url + "/v1/models", timeout=5).status_code == 200
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        assert not process_alive(followers[0])
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def _cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode()


def _lines_until(proc: subprocess.Popen[str], pattern: re.Pattern[str], *,
                 within_s: float) -> list[str]:
    """The process's stderr lines up to the first matching `pattern` (read by a thread,
    so a silent process cannot block the test); AssertionError with what it printed if
    it exits or `within_s` passes first. The thread reads on: stderr never fills."""
    assert proc.stderr is not None
    stream = proc.stderr
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        for line in stream:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    seen: list[str] = []
    deadline = time.monotonic() + within_s
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            break
        if line is None:
            break
        seen.append(line)
        if pattern.search(line):
            return seen
    raise AssertionError(f"no line matching {pattern.pattern!r}:\n" + "\n".join(seen))


def test_ready_counts_are_logged_until_every_replica_first_is(caplog):
    pool = ReplicaPool([Replica(id="r0", url="http://r0"), Replica(id="r1", url="http://r1")])
    announce_ready(pool, since=time.monotonic())
    r0, r1 = pool.get("r0"), pool.get("r1")
    assert r0 is not None and r1 is not None
    with caplog.at_level(logging.INFO, logger="dpserve.serve"):
        pool.set_state(r0, ReplicaState.READY)
        pool.set_state(r0, ReplicaState.DOWN, "died")
        pool.set_state(r0, ReplicaState.READY)  # 1 of 2 again: already said
        pool.set_state(r1, ReplicaState.READY)
        pool.set_state(r1, ReplicaState.DOWN, "died")
        pool.set_state(r1, ReplicaState.READY)  # a restart later: the pool logs it
    said = [r.getMessage() for r in caplog.records if r.name == "dpserve.serve"]
    assert said == ["1/2 replicas ready after 0 s", "2/2 replicas ready after 0 s"]


def test_a_busy_port_names_its_flag_and_says_what_to_do():
    taken = bind_socket("127.0.0.1", 0)
    taken.listen()
    port = taken.getsockname()[1]
    try:
        with pytest.raises(PortInUseError) as exc:
            listen(RouterConfig(port=port))
    finally:
        taken.close()
    assert str(exc.value) == (f"--port {port}: cannot listen on 127.0.0.1:{port}: Address "
                              "already in use (another process listens there; pick another "
                              "port, or 0 for a free one)")


def test_an_address_not_of_this_machine_names_the_host_flag():
    with pytest.raises(PortInUseError, match=r"^--host 192\.0\.2\.1: cannot listen on "
                                             r".*\(not an address of this machine\)$"):
        listen(RouterConfig(host="192.0.2.1", port=0, insecure_admin=True))
