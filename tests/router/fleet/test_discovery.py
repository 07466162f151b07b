"""DNS discovery: the pure diff, the pool following a stub resolver, and a real
`dpserve router --discover dns://localhost:PORT` in front of a fake replica process."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from dpserve.config import (
    ConfigError,
    DiscoveryError,
    DnsTarget,
    RouterConfig,
    build_router_config,
    parse_target,
)
from dpserve.replicas.launcher import free_port
from dpserve.router.fleet.discovery import Discovery, LookupFailed, diff, resolve_a_records
from dpserve.router.fleet.pool import Replica, ReplicaPool, ReplicaState
from dpserve.router.routing.dispatch import Dispatcher
from dpserve.router.routing.policies import RequestInfo, make_policy
from tests.waiting import wait_for_sync

FAKE = str(Path(__file__).parents[2] / "fake_vllm_server.py")


def test_a_dns_target_names_a_host_and_a_port():
    assert parse_target("dns://engine.dpserve.svc.cluster.local:8000") == DnsTarget(
        "engine.dpserve.svc.cluster.local", 8000)


@pytest.mark.parametrize("text", ["engine:8000", "http://engine:8000", "dns://engine",
                                  "dns://:8000", "dns://engine:0", "dns://engine:99999",
                                  "dns://engine:8000/v1", "dns://engine:port"])
def test_a_malformed_dns_target_is_refused(text):
    with pytest.raises(DiscoveryError, match="dns://NAME:PORT"):
        parse_target(text)


def test_the_config_refuses_a_malformed_target_naming_the_setting():
    with pytest.raises(ConfigError, match=r"router\.discover: expected dns://NAME:PORT"):
        build_router_config({"discover": "engine:8000"}, env={})
    cfg = build_router_config({}, {"discover": "dns://engine:8000"}, env={})
    assert cfg.discover == "dns://engine:8000" and cfg.discover_interval_s == 5.0


def test_diff_adds_new_addresses_and_removes_vanished_ones():
    known = {"10.0.0.1:8000": "http://10.0.0.1:8000", "10.0.0.2:8000": "http://10.0.0.2:8000"}
    change = diff(known, ["10.0.0.3", "10.0.0.1", "10.0.0.3"], 8000)
    assert change.added == {"10.0.0.3:8000": "http://10.0.0.3:8000"}
    assert change.removed == ["10.0.0.2:8000"]


def test_diff_of_an_unchanged_answer_is_empty():
    known = {"10.0.0.1:8000": "http://10.0.0.1:8000"}
    change = diff(known, ["10.0.0.1"], 8000)
    assert change.added == {} and change.removed == []


class StubResolver:
    """Answers each lookup with the next scripted list; an exception is raised instead."""

    def __init__(self, *answers: list[str] | Exception) -> None:
        self.answers = list(answers)
        self.names: list[str] = []

    async def __call__(self, name: str) -> list[str]:
        self.names.append(name)
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


def discovery(pool: ReplicaPool, resolver: StubResolver) -> Discovery:
    return Discovery(pool, DnsTarget("engine.ns.svc", 8000), interval_s=1.0, resolver=resolver,
                     weight_version=lambda: "base:tiny")


async def test_the_pool_follows_the_a_records_as_pods_come_and_go():
    pool = ReplicaPool([])
    resolver = StubResolver(["10.0.0.1", "10.0.0.2"], ["10.0.0.2", "10.0.0.3"])
    d = discovery(pool, resolver)
    await d.refresh()
    assert [(r.id, r.url, r.state) for r in pool] == [
        ("10.0.0.1:8000", "http://10.0.0.1:8000", ReplicaState.STARTING),
        ("10.0.0.2:8000", "http://10.0.0.2:8000", ReplicaState.STARTING)]
    assert all(r.weight_version == "base:tiny" for r in pool)
    await d.refresh()
    assert [r.id for r in pool] == ["10.0.0.2:8000", "10.0.0.3:8000"]
    assert resolver.names == ["engine.ns.svc", "engine.ns.svc"]


async def test_a_removed_replica_leaves_rotation_and_its_request_in_flight_finishes():
    pool = ReplicaPool([])
    d = discovery(pool, StubResolver(["10.0.0.1", "10.0.0.2"], ["10.0.0.2"]))
    await d.refresh()
    for r in pool:
        pool.set_state(r, ReplicaState.READY)
    leaving = pool.get("10.0.0.1:8000")
    seen = []
    pool.on_state_change(lambda r, old, new: seen.append((r.id, new)))
    dispatcher = Dispatcher(pool, make_policy("round-robin"), RouterConfig())
    slot = await dispatcher.choose(RequestInfo(route="/v1/completions"),
                                   tried=["10.0.0.2:8000"])
    assert slot.replica is leaving
    with slot:
        await d.refresh()
        assert [r.id for r in pool.ready()] == ["10.0.0.2:8000"]
        assert leaving.in_flight == 1
    assert leaving.in_flight == 0 and pool.get("10.0.0.1:8000") is None
    assert seen == [("10.0.0.1:8000", ReplicaState.DOWN)]


async def test_a_failed_lookup_keeps_the_fleet_but_a_name_gone_empties_it():
    pool = ReplicaPool([])
    d = discovery(pool, StubResolver(["10.0.0.1"], LookupFailed("engine.ns.svc: timeout"), []))
    await d.refresh()
    assert await d.refresh() is None
    assert [r.id for r in pool] == ["10.0.0.1:8000"]
    await d.refresh()  # NXDOMAIN: the headless Service has no ready pod left
    assert len(pool) == 0


async def test_replicas_given_on_the_command_line_are_never_removed():
    pool = ReplicaPool([Replica(id="r0", url="http://10.9.9.9:8000")])
    d = discovery(pool, StubResolver(["10.0.0.1"], []))
    await d.refresh()
    await d.refresh()
    assert [r.id for r in pool] == ["r0"]


async def test_the_system_resolver_finds_localhost_and_no_records_for_an_unknown_name():
    assert await resolve_a_records("localhost") == ["127.0.0.1"]
    assert await resolve_a_records("no-such-engine.invalid") == []


def _poll(url: str, check, deadline_s: float) -> httpx.Response:
    def answer() -> httpx.Response | None:
        try:
            resp = httpx.get(url, timeout=2.0)
        except httpx.HTTPError:
            return None
        return resp if check(resp) else None

    return wait_for_sync(answer, f"the expected answer from {url}", within_s=deadline_s,
                         every_s=0.1)


def test_dpserve_router_discovers_a_replica_by_resolving_localhost(tmp_path):
    replica_port, router_port = free_port(), free_port()
    replica = subprocess.Popen([sys.executable, FAKE, "--port", str(replica_port)],
                               stdout=subprocess.DEVNULL, start_new_session=True)
    router = subprocess.Popen(
        [sys.executable, "-m", "dpserve", "router", "--discover",
         f"dns://localhost:{replica_port}", "--discover-interval-s", "0.2",
         "--health-interval-s", "0.2", "--port", str(router_port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{router_port}"
    try:
        try:
            resp = _poll(base + "/admin/replicas",
                         lambda r: r.status_code == 200 and any(
                             x["state"] == "ready" for x in r.json()["replicas"]), 30)
            (found,) = resp.json()["replicas"]
            assert found["id"] == f"127.0.0.1:{replica_port}"
            assert found["url"] == f"http://127.0.0.1:{replica_port}"
            models = httpx.get(base + "/v1/models", timeout=5).json()
            assert [m["id"] for m in models["data"]] == ["fake-model"]
        finally:
            replica.send_signal(signal.SIGTERM)
            replica.wait(timeout=10)
        # Its engine gone, the replica leaves rotation (the name still resolves, so it
        # stays listed, down, until the health checks see it back).
        _poll(base + "/ready", lambda r: r.status_code == 503, 15)
    finally:
        router.send_signal(signal.SIGTERM)
        out, _ = router.communicate(timeout=30)
    assert router.returncode == 0, out
    assert f"found replica 127.0.0.1:{replica_port}" in out


def test_dpserve_router_needs_replicas_or_a_discovery_target():
    proc = subprocess.run([sys.executable, "-m", "dpserve", "router"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2
    assert "give at least one --replica URL, or --discover" in proc.stderr
