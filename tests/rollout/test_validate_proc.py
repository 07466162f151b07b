"""A full checkpoint is snapshotted and checked in a child process: it answers as the
in-process checks would, serves one deploy after another, and a child that dies or is
cancelled is replaced and leaves nothing behind."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest

from dpserve.rollout.deployed import checkpoint_weights, weights_for
from dpserve.rollout.validate import Refused
from dpserve.rollout.validate_proc import Checker, Job, ValidationCrashed
from tests.rollout.checkpoints import perturbed, write_variant
from tests.waiting import wait_for_sync


def job(ckpt_dir: Path, base: Path, root: Path, store: Path) -> Job:
    return Job(checkpoint=str(ckpt_dir), within=str(root), base=str(base), store=str(store))


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True  # killed and reaped: not even a zombie
    return False


async def test_one_child_checks_deploy_after_deploy_and_ends_with_the_router(
        tiny_model, tmp_path):
    root, store = tmp_path / "ckpts", tmp_path / "store"
    checker = Checker()
    try:
        await checker.start()
        pid = checker._proc.pid  # type: ignore[union-attr]
        for step in (1, 2):
            ckpt_dir = write_variant(tiny_model, root, step, tensors=perturbed(0.01, seed=step))
            snapshot, meta = await checker.check(job(ckpt_dir, tiny_model, root, store))
            assert snapshot.parent == store and meta.step == step
            assert (checkpoint_weights(snapshot, meta).version
                    == weights_for(str(ckpt_dir)).version)
        assert checker._proc is not None and checker._proc.pid == pid  # the same child
    finally:
        await checker.aclose()
    assert gone(pid)


async def test_the_childs_refusals_reach_the_router_whole(tiny_model, tmp_path):
    def diverged(t):
        t["model.layers.0.mlp.up_proj.weight"][0, 0] = float("nan")
        return t
    root = tmp_path / "ckpts"
    nan = write_variant(tiny_model, root, 1, tensors=diverged)
    outside = write_variant(tiny_model, tmp_path / "elsewhere", 2)
    checker = Checker()
    try:
        with pytest.raises(Refused) as refused_nan:
            await checker.check(job(nan, tiny_model, root, tmp_path / "store"))
        with pytest.raises(Refused) as refused_outside:
            await checker.check(job(outside, tiny_model, root, tmp_path / "store"))
    finally:
        await checker.aclose()
    assert refused_nan.value.status == 422 and refused_nan.value.param == "checkpoint"
    assert "model.layers.0.mlp.up_proj.weight holds NaN" in refused_nan.value.message
    assert refused_outside.value.status == 403
    assert "--checkpoint-root" in refused_outside.value.message


async def test_a_child_that_dies_without_an_answer_is_a_crash_and_the_next_check_gets_a_new_one(
        tiny_model, tmp_path):
    root = tmp_path / "ckpts"
    ckpt_dir = write_variant(tiny_model, root, 1)
    checker = Checker()
    try:
        await checker.start()
        dying = checker._proc
        assert dying is not None
        dying.kill()  # as the OOM killer would
        with pytest.raises(ValidationCrashed, match="exited with -9"):
            await checker.check(job(ckpt_dir, tiny_model, root, tmp_path / "store"))
        _, meta = await checker.check(job(ckpt_dir, tiny_model, root, tmp_path / "store"))
    finally:
        await checker.aclose()
    assert meta.step == 1 and gone(dying.pid)


async def test_a_crash_names_the_end_of_the_childs_stderr(tiny_model, tmp_path):
    checker = Checker(command=(sys.executable, "-c", "import sys; sys.stdin.readline(); "
                               "sys.stderr.write('MemoryError\\n'); sys.exit(3)"))
    try:
        with pytest.raises(ValidationCrashed, match="exited with 3: MemoryError"):
            await checker.check(job(tmp_path, tiny_model, tmp_path, tmp_path / "store"))
    finally:
        await checker.aclose()


async def test_a_cancelled_check_kills_and_reaps_its_child(tiny_model, tmp_path):
    pid_file = tmp_path / "pid"
    checker = Checker(command=(
        sys.executable, "-c",
        f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); "
        "time.sleep(600)"))
    checking = asyncio.create_task(checker.check(
        job(tmp_path, tiny_model, tmp_path, tmp_path / "store")))
    await asyncio.to_thread(wait_for_sync, lambda: pid_file.exists() and pid_file.read_text(),
                            "the child to start")
    pid = int(pid_file.read_text())
    checking.cancel()
    with pytest.raises(asyncio.CancelledError):
        await checking
    assert gone(pid)
    await checker.aclose()


async def test_the_child_gets_none_of_dpserves_settings(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("DPSERVE_ADMIN_KEY", "s3cret")
    monkeypatch.setenv("DPSERVE_API_KEYS", "a,b")
    shows_its_settings = (
        sys.executable, "-c", "import os, sys; sys.stdin.readline(); sys.stderr.write("
        "'settings: ' + ','.join(sorted(k for k in os.environ if k.startswith('DPSERVE'))) "
        "+ '; PATH' * ('PATH' in os.environ)); sys.exit(1)")
    checker = Checker(command=shows_its_settings)
    try:
        with pytest.raises(ValidationCrashed) as crashed:
            await checker.check(job(tmp_path, tiny_model, tmp_path, tmp_path / "store"))
    finally:
        await checker.aclose()
    assert str(crashed.value).endswith("settings: ; PATH")  # the rest of the env is kept
