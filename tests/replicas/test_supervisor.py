"""The supervisor against fake replica processes (tests/fake_vllm_server.py).

Real vLLM replicas are covered in tests/integration; these cases need a
replica that fails on cue and must not cost a minute of vLLM start-up each.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

from dpserve.config import ServeConfig
from dpserve.replicas.launcher import ReplicaSpec, free_port
from dpserve.replicas.supervisor import (
    ReplicaStartError,
    Supervisor,
    restart_delay,
)
from dpserve.router.fleet.pool import Replica, ReplicaPool, ReplicaState
from tests.procs import processes_in_group
from tests.waiting import wait_for, wait_for_sync

FAKE = str(Path(__file__).parents[1] / "fake_vllm_server.py")


def fake_specs(tmp_path: Path, n: int, *extra: str) -> list[ReplicaSpec]:
    specs = []
    for i in range(n):
        port = free_port()
        specs.append(ReplicaSpec(
            id=f"r{i}", port=port, device="cpu:0",
            argv=(sys.executable, FAKE, "--port", str(port), *extra),
            env={}, log_path=tmp_path / f"replica-r{i}.log",
        ))
    return specs


def setup(tmp_path: Path, n: int, *extra: str, **cfg: object):
    specs = fake_specs(tmp_path, n, *extra)
    pool = ReplicaPool([Replica(id=s.id, url=s.url) for s in specs])
    settings = {"startup_timeout_s": 20, "restart_backoff_s": 0.2, "stop_timeout_s": 5, **cfg}
    config = ServeConfig(model="fake", **settings)  # type: ignore[arg-type]
    return Supervisor(specs, pool, config), pool


def test_restart_backoff_doubles_up_to_the_cap():
    assert [restart_delay(n, 1.0, 10.0) for n in range(1, 7)] == [1, 2, 4, 8, 10, 10]


async def test_stop_leaves_no_process_of_any_replica(tmp_path):
    sup, _ = setup(tmp_path, 2)
    await sup.start()
    pids = sup.pids
    assert all(len(processes_in_group(p)) == 2 for p in pids.values())  # server + "engine core"
    await sup.stop()
    assert all(processes_in_group(p) == [] for p in pids.values())


async def test_a_replica_that_exits_at_startup_is_a_clear_error_with_its_log(tmp_path):
    sup, _ = setup(tmp_path, 1, "--fail-after-s", "0.2")
    try:
        with pytest.raises(ReplicaStartError) as exc:
            await sup.start()
    finally:
        await sup.stop()
    message = str(exc.value)
    assert "replica r0 failed to start: process exited with code 3" in message
    assert "fake engine failed to load the model" in message


async def test_a_replica_that_never_gets_healthy_times_out_with_its_log(tmp_path):
    sup, _ = setup(tmp_path, 1, "--startup-delay-s", "60", startup_timeout_s=1.0)
    try:
        with pytest.raises(ReplicaStartError, match="no healthy /health within 1 s"):
            await sup.start()
    finally:
        await sup.stop()


async def test_a_replica_that_dies_is_taken_out_at_once_and_restarted(tmp_path):
    sup, pool = setup(tmp_path, 2)
    restarted = []
    sup._on_restart = restarted.append
    await sup.start()
    try:
        for r in pool:  # the router's health loop would do this
            pool.set_state(r, ReplicaState.READY)
        old_pid = sup.pids["r0"]
        loop = asyncio.get_running_loop()
        killed_at = loop.time()
        os.killpg(old_pid, signal.SIGKILL)
        await wait_for(lambda: pool.get("r0").state is not ReplicaState.READY,
                       "r0 to leave rotation", within_s=1.0)
        assert loop.time() - killed_at < 1.0
        assert [r.id for r in pool.ready()] == ["r1"]
        await wait_for(lambda: sup.pids["r0"] != old_pid and sup._replicas[0].ready.is_set(),
                       "r0 to be restarted and healthy", within_s=15.0)
        assert restarted == ["r0"]
        assert processes_in_group(old_pid) == []
        assert pool.get("r0").state is ReplicaState.STARTING  # health loop re-admits it
    finally:
        await sup.stop()


_SUPERVISOR_SCRIPT = """
import asyncio, json, sys
from pathlib import Path
from dpserve.config import ServeConfig
from dpserve.replicas.launcher import ReplicaSpec
from dpserve.replicas.supervisor import Supervisor
from dpserve.router.fleet.pool import Replica, ReplicaPool

async def main():
    spec = ReplicaSpec(**json.loads(sys.argv[1]), log_path=Path(sys.argv[2]))
    sup = Supervisor([spec], ReplicaPool([Replica(id=spec.id, url=spec.url)]),
                     ServeConfig(model="fake", startup_timeout_s=20))
    await sup.start()
    print(sup.pids[spec.id], flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


def test_replicas_die_with_a_supervisor_that_was_killed(tmp_path):
    """SIGKILL gives the supervisor no chance to clean up: the replicas must
    still not outlive it (they get SIGTERM when their parent dies)."""
    import json
    import subprocess

    (spec,) = fake_specs(tmp_path, 1)
    fields = {"id": spec.id, "port": spec.port, "device": spec.device,
              "argv": list(spec.argv), "env": spec.env}
    proc = subprocess.Popen([sys.executable, "-c", _SUPERVISOR_SCRIPT, json.dumps(fields),
                             str(spec.log_path)], stdout=subprocess.PIPE, text=True)
    try:
        replica_pid = int(proc.stdout.readline())
        assert len(processes_in_group(replica_pid)) == 2
        proc.kill()
        proc.wait()
        wait_for_sync(lambda: processes_in_group(replica_pid) == [],
                      "the replica's process group to exit with its supervisor", every_s=0.05)
    finally:
        if proc.poll() is None:
            proc.kill()


async def test_replicas_never_see_the_routers_keys(tmp_path, monkeypatch):
    monkeypatch.setenv("DPSERVE_API_KEY", "client-secret-1")
    monkeypatch.setenv("DPSERVE_API_KEYS", "client-secret-2,client-secret-3")
    monkeypatch.setenv("DPSERVE_ADMIN_KEY", "admin-secret-0123456789")
    monkeypatch.setenv("DPSERVE_TEST_UNRELATED", "x")
    sup, _ = setup(tmp_path, 1)
    await sup.start()
    try:
        environ = await asyncio.to_thread(Path(f"/proc/{sup.pids['r0']}/environ").read_bytes)
    finally:
        await sup.stop()
    assert b"secret" not in environ
    assert b"DPSERVE_" not in environ
    assert b"PATH=" in environ  # the rest of the environment is passed on


async def test_a_cpu_replica_and_its_engine_run_only_on_the_replicas_cores(tmp_path):
    usable = sorted(os.sched_getaffinity(0))
    (spec,) = fake_specs(tmp_path, 1)
    spec = dataclasses.replace(spec, cores=(usable[-1],))
    pool = ReplicaPool([Replica(id=spec.id, url=spec.url)])
    sup = Supervisor([spec], pool, ServeConfig(model="fake", startup_timeout_s=20,
                                                stop_timeout_s=5))
    await sup.start()
    try:
        group = processes_in_group(sup.pids["r0"])
        assert len(group) == 2  # server + "engine core", which inherits the binding
        assert all(os.sched_getaffinity(pid) == {usable[-1]} for pid in group)
    finally:
        await sup.stop()


async def test_a_replica_slow_to_start_says_so_now_and_then_with_its_phase_and_log(
        tmp_path, caplog):
    specs = fake_specs(tmp_path, 1, "--startup-delay-s", "1.6")
    pool = ReplicaPool([Replica(id=s.id, url=s.url) for s in specs])
    sup = Supervisor(specs, pool, ServeConfig(model="fake", startup_timeout_s=20),
                     still_starting_every_s=0.5)
    with caplog.at_level(logging.INFO, logger="dpserve.supervisor"):
        try:
            await sup.start()
        finally:
            await sup.stop()
    notes = [r.getMessage() for r in caplog.records if "still starting" in r.getMessage()]
    assert len(notes) >= 2, notes  # at 0.5, 1.0 and 1.5 s, give or take a loaded machine
    log_path = re.escape(str(tmp_path / "replica-r0.log"))
    assert all(re.fullmatch(r"replica r0: still starting after \d+ s: starting Python and "
                            rf"importing vLLM \(log: {log_path}\)", note)
               for note in notes), notes  # the fake prints none of vLLM's milestones


async def test_stop_says_how_long_it_waits_and_force_kills_at_once(tmp_path, caplog):
    """Replicas that ignore SIGTERM (an engine busy loading): stop says it waits up to
    stop_timeout_s and that Ctrl-C again kills now; `force` (that second Ctrl-C) kills
    them then, long before the timeout."""
    sup, _ = setup(tmp_path, 2, "--ignore-sigterm", stop_timeout_s=60)
    await sup.start()
    pids = sup.pids
    caplog.set_level(logging.INFO, logger="dpserve.supervisor")
    stopping = asyncio.create_task(sup.stop())
    try:
        await wait_for(lambda: "stopping 2 replica(s): up to 60 s each to exit, then "
                               "killed (Ctrl-C again kills them now)" in caplog.text,
                       "stop's notice")
        started = time.monotonic()
    finally:  # whatever failed above: nothing left behind
        sup.force()
        await asyncio.wait_for(stopping, 30)
    assert time.monotonic() - started < 20  # not the 60 s
    assert all(processes_in_group(p) == [] for p in pids.values())
    assert "replica r0: killed without waiting" in caplog.text
