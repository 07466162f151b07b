"""The supervisor (re)starts replicas on the deployed weights, against fake replica
processes (tests/fake_vllm_server.py): a restart of real vLLM costs a minute, and the
command line is what is under test here."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from dpserve.config import ServeConfig
from dpserve.replicas.launcher import argv_with_model
from dpserve.replicas.supervisor import Supervisor
from dpserve.rollout.deployed import Deployed, Weights
from dpserve.router.fleet.pool import Replica, ReplicaPool, ReplicaState
from tests.procs import processes_in_group
from tests.replicas.test_supervisor import fake_specs
from tests.waiting import wait_for

BASE = Weights("/models/base", "base:base")
CHECKPOINT = Weights("/ckpts/step-000005", "step-000005@0123abcd", 5)


def setup(tmp_path: Path, deployed: Deployed, **cfg: object
          ) -> tuple[Supervisor, ReplicaPool]:
    specs = fake_specs(tmp_path, 1, "--model", "/ignored-by-the-fake")
    pool = ReplicaPool([Replica(id=s.id, url=s.url) for s in specs])
    settings = {"startup_timeout_s": 20, "restart_backoff_s": 0.2, "stop_timeout_s": 5, **cfg}
    config = ServeConfig(model="fake", **settings)  # type: ignore[arg-type]
    return Supervisor(specs, pool, config, deployed=deployed), pool


def cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_text().split("\0")


def test_the_model_argument_is_replaced_and_the_served_name_kept():
    argv = ("python", "-m", "vllm", "--model", "/base", "--served-model-name", "tiny")
    assert argv_with_model(argv, "/ckpt") == (
        "python", "-m", "vllm", "--model", "/ckpt", "--served-model-name", "tiny")


async def test_a_replica_that_dies_restarts_on_the_deployed_checkpoint(tmp_path):
    deployed = Deployed(BASE)
    sup, pool = setup(tmp_path, deployed)
    await sup.start()
    try:
        first = sup.pids["r0"]
        assert cmdline(first)[cmdline(first).index("--model") + 1] == BASE.path
        assert sup.launched("r0") == (1, BASE.version)
        deployed.current = CHECKPOINT  # a deploy happened
        os.killpg(first, signal.SIGKILL)
        await wait_for(lambda: sup.pids.get("r0") not in (None, first), "a new process",
                       within_s=20)
        await wait_for(lambda: pool.get("r0").state is not ReplicaState.DOWN, "restart",
                       within_s=20)
        args = cmdline(sup.pids["r0"])
        assert args[args.index("--model") + 1] == CHECKPOINT.path
        assert sup.launched("r0") == (2, CHECKPOINT.version)
        assert pool.get("r0").weight_version == CHECKPOINT.version
    finally:
        await sup.stop()
    assert processes_in_group(first) == []


async def test_a_requested_restart_skips_the_crash_backoff(tmp_path):
    sup, pool = setup(tmp_path, Deployed(BASE), restart_backoff_s=30.0,
                      restart_backoff_max_s=60.0)
    await sup.start()
    try:
        first = sup.pids["r0"]
        seen: list[str] = []
        pool.on_state_change(lambda r, old, new: seen.append(new.value))
        await sup.restart("r0", "the rollout could not reload it")
        # the launch is counted before its process exists: wait for both
        await wait_for(lambda: sup.launched("r0")[0] == 2 and sup.pids["r0"] != first,
                       "a restart without backoff", within_s=15)
        # out of the health loop's reach while the old process stops, then starting
        assert seen[:3] == ["draining", "down", "starting"]
    finally:
        await sup.stop()
