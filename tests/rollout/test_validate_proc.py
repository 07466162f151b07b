"""A full checkpoint is snapshotted and checked in a child process: it answers as the
in-process checks would, and a child that dies or is cancelled leaves nothing behind."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest

from dpserve.rollout.deployed import checkpoint_weights, weights_for
from dpserve.rollout.validate import Refused
from dpserve.rollout.validate_proc import (
    Job,
    ValidationCrashed,
    check_in_child,
    child_environment,
)
from tests.rollout.checkpoints import perturbed, write_variant
from tests.waiting import wait_for_sync


def job(ckpt_dir: Path, base: Path, root: Path, store: Path) -> Job:
    return Job(checkpoint=str(ckpt_dir), within=str(root), base=str(base), store=str(store))


async def test_a_sound_checkpoint_is_snapshotted_and_named_by_its_version(tiny_model, tmp_path):
    ckpt_dir = write_variant(tiny_model, tmp_path / "ckpts", 3, tensors=perturbed(0.01, seed=3))
    snapshot, meta = await check_in_child(job(ckpt_dir, tiny_model, tmp_path / "ckpts",
                                              tmp_path / "store"))
    assert snapshot.parent == tmp_path / "store" and meta.step == 3
    assert checkpoint_weights(snapshot, meta).version == weights_for(str(ckpt_dir)).version


async def test_the_childs_refusals_reach_the_router_whole(tiny_model, tmp_path):
    def diverged(t):
        t["model.layers.0.mlp.up_proj.weight"][0, 0] = float("nan")
        return t
    root = tmp_path / "ckpts"
    nan = write_variant(tiny_model, root, 1, tensors=diverged)
    outside = write_variant(tiny_model, tmp_path / "elsewhere", 2)
    with pytest.raises(Refused) as refused_nan:
        await check_in_child(job(nan, tiny_model, root, tmp_path / "store"))
    with pytest.raises(Refused) as refused_outside:
        await check_in_child(job(outside, tiny_model, root, tmp_path / "store"))
    assert refused_nan.value.status == 422 and refused_nan.value.param == "checkpoint"
    assert "model.layers.0.mlp.up_proj.weight holds NaN" in refused_nan.value.message
    assert refused_outside.value.status == 403
    assert "--checkpoint-root" in refused_outside.value.message


async def test_a_child_that_dies_without_an_answer_is_a_crash_naming_its_stderr(
        tiny_model, tmp_path):
    dying = (sys.executable, "-c", "import sys; sys.stderr.write('out of memory'); sys.exit(3)")
    with pytest.raises(ValidationCrashed, match="exited with 3: out of memory"):
        await check_in_child(job(tmp_path, tiny_model, tmp_path, tmp_path / "store"),
                             command=dying)


async def test_a_cancelled_check_kills_and_reaps_its_child(tiny_model, tmp_path):
    pid_file = tmp_path / "pid"
    hanging = (sys.executable, "-c",
               f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); "
               "time.sleep(600)")
    checking = asyncio.create_task(check_in_child(
        job(tmp_path, tiny_model, tmp_path, tmp_path / "store"), command=hanging))
    await asyncio.to_thread(wait_for_sync, lambda: pid_file.exists() and pid_file.read_text(),
                            "the child to start")
    pid = int(pid_file.read_text())
    checking.cancel()
    with pytest.raises(asyncio.CancelledError):
        await checking
    with pytest.raises(ProcessLookupError):  # killed and reaped: not even a zombie
        os.kill(pid, 0)


def test_the_child_gets_none_of_dpserves_settings():
    env = child_environment({"PATH": "/usr/bin", "DPSERVE_ADMIN_KEY": "s3cret",
                             "DPSERVE_API_KEYS": "a,b", "HOME": "/root"})
    assert env == {"PATH": "/usr/bin", "HOME": "/root"}
