"""A deploy loads exactly what it validated, and no checkpoint can hang, flood or
mislead validation; the admin body is held to its fields and to finite numbers.

Each hostile checkpoint is published the way a fine-tune job (or anyone with the
shared volume) could, and deployed through `/admin/deploy` on a router in front
of the shared fake replicas: the answer must be a 4xx within seconds, nothing
may change, and the deploy lock must be free for the next deploy.
"""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import stat
import struct
from pathlib import Path

import httpx
import pytest

from dpserve.checkpoint import META_FILE, CheckpointError
from dpserve.finetune.state import load_tensors_only
from dpserve.rollout.lock import DeployLock
from tests.rollout.checkpoints import perturbed, write_variant
from tests.rollout.fleet import deploy, fleet
from tests.waiting import wait_for

pytestmark = pytest.mark.timeout(60)  # a hang is the failure these tests look for


@pytest.fixture
def checkpoint(tiny_model: Path, tmp_path: Path) -> Path:
    return write_variant(tiny_model, tmp_path / "out", 3, tensors=perturbed(0.01, seed=3))


async def test_the_engines_load_the_validated_bytes_even_if_the_checkpoint_changes_after(
        fake_replicas, tiny_model, checkpoint):
    weights = checkpoint / "model.safetensors"
    original = weights.read_bytes()
    async with fleet(fake_replicas, tiny_model, 2) as f:
        async with httpx.AsyncClient(base_url=f.base, timeout=30) as c:
            started = await c.post("/admin/deploy", json={"checkpoint": str(checkpoint)})
            assert started.status_code == 202
            # The attacker (or a careless job) rewrites a tensor once the deploy has begun.
            weights.chmod(0o644)
            tampered = bytearray(original)
            tampered[-8:] = b"\x00\x00\xc0\x7f" * 2  # NaNs
            weights.write_bytes(bytes(tampered))
            await f.rollout.wait()
            record = (await c.get(f"/admin/deploy/{started.json()['id']}")).json()
        assert record["state"] == "succeeded", record
        snapshot = Path(record["snapshot"])
        assert all(fake.weights == str(snapshot) for fake in f.fakes)
        loaded = await asyncio.to_thread((snapshot / "model.safetensors").read_bytes)
        assert loaded == original
        assert not snapshot.is_relative_to(checkpoint)
        mode = (snapshot / "model.safetensors").stat().st_mode
        assert not mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH)  # read-only


async def test_a_file_changed_before_the_copy_is_refused_and_a_redeploy_reuses_the_snapshot(
        fake_replicas, tiny_model, checkpoint, tmp_path):
    async with fleet(fake_replicas, tiny_model, 2) as f:
        status, first = await deploy(f, checkpoint)
        status_again, again = await deploy(f, checkpoint)
        changed = write_variant(tiny_model, tmp_path / "other", 4, tensors=perturbed(0.01, 4))
        weights = changed / "model.safetensors"
        data = bytearray(weights.read_bytes())
        data[-3] ^= 0xFF
        weights.write_bytes(bytes(data))
        refused, body = await deploy(f, changed)
    assert (status, status_again) == (202, 202)
    assert again["snapshot"] == first["snapshot"]  # same manifest: not copied twice
    assert refused == 422
    assert "model.safetensors does not match its sha256" in body["error"]["message"]


def fifo_meta(ckpt: Path) -> None:
    os.unlink(ckpt / META_FILE)
    os.mkfifo(ckpt / META_FILE)


def fifo_tensor(ckpt: Path) -> None:
    os.unlink(ckpt / "model.safetensors")
    os.mkfifo(ckpt / "model.safetensors")


def zero_meta(ckpt: Path) -> None:
    os.unlink(ckpt / META_FILE)
    os.symlink("/dev/zero", ckpt / META_FILE)


def zero_tensor(ckpt: Path) -> None:
    os.unlink(ckpt / "model.safetensors")
    os.symlink("/dev/zero", ckpt / "model.safetensors")


def rewrite_offsets(change):  # type: ignore[no-untyped-def]
    """A checkpoint whose safetensors header is edited by `change`, then hashed and
    published properly: only the header's layout is wrong."""
    def files(tmp: Path) -> None:
        path = tmp / "model.safetensors"
        raw = path.read_bytes()
        (length,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8:8 + length])
        change(header)
        text = json.dumps(header).encode()
        path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + length:])
    return files


def reversed_offsets(header: dict) -> None:
    name = next(k for k in header if k != "__metadata__")
    begin, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [end, begin]


def out_of_range(header: dict) -> None:
    name = next(k for k in header if k != "__metadata__")
    header[name]["data_offsets"][1] += 10 ** 9


def overlapping(header: dict) -> None:
    names = sorted((k for k in header if k != "__metadata__"),
                   key=lambda k: header[k]["data_offsets"])
    header[names[1]]["data_offsets"] = list(header[names[0]]["data_offsets"])
    header[names[1]]["shape"] = header[names[0]]["shape"]


@pytest.mark.parametrize("break_it, status, says", [
    (fifo_meta, 422, "only regular files"),
    (zero_meta, 422, "symbolic links are not allowed"),
    (fifo_tensor, 422, "only regular files"),
    (zero_tensor, 422, "symbolic links are not allowed"),
], ids=["fifo-metadata", "dev-zero-metadata", "fifo-tensor", "dev-zero-tensor"])
async def test_special_files_are_refused_at_once_and_the_lock_is_released(
        fake_replicas, tiny_model, checkpoint, tmp_path, break_it, status, says):
    break_it(checkpoint)
    lock = DeployLock(tmp_path / "deploy.lock", ttl_s=30)  # to look at it
    async with fleet(fake_replicas, tiny_model, 2, deploy_lock=str(lock.path),
                     deploy_lock_ttl_s=30) as f:
        refused, body = await asyncio.wait_for(deploy(f, checkpoint), 10)
        assert (refused, says in body["error"]["message"]) == (status, True), body
        assert not lock.path.exists()
        good = write_variant(tiny_model, tmp_path / "good", 5, tensors=perturbed(0.01, 5))
        ok, record = await deploy(f, good)  # the next deploy is not told "409 in progress"
    assert ok == 202 and record["state"] == "succeeded"
    assert all(fake.dev_calls[:1] != ["/collective_rpc"] for fake in f.fakes)


@pytest.mark.parametrize("change, says", [
    (reversed_offsets, "reversed or outside"),
    (out_of_range, "reversed or outside"),
    (overlapping, "overlap"),
], ids=["reversed", "out-of-range", "overlapping"])
async def test_tensor_offsets_that_do_not_fit_the_file_are_refused(
        fake_replicas, tiny_model, tmp_path, change, says):
    bad = write_variant(tiny_model, tmp_path / "out", 6, files=rewrite_offsets(change))
    async with fleet(fake_replicas, tiny_model, 2) as f:
        status, body = await deploy(f, bad)
    assert status == 422 and says in body["error"]["message"], body
    # Named as deployed, not as the snapshot copy that was checked.
    assert body["error"]["message"].startswith(str(bad)), body
    assert all(fake.weights is None for fake in f.fakes)


async def test_a_checkpoint_outside_the_checkpoint_root_is_refused(
        fake_replicas, tiny_model, checkpoint, tmp_path):
    root = tmp_path / "allowed"
    root.mkdir()
    (root / "sneaky").symlink_to(checkpoint)  # a link inside the root does not help
    async with fleet(fake_replicas, tiny_model, 2, checkpoint_root=root) as f:
        direct, body = await deploy(f, checkpoint)
        linked, _ = await deploy(f, root / "sneaky")
    assert direct == linked == 403
    assert "is not inside the checkpoint root" in body["error"]["message"]
    assert "--checkpoint-root" in body["error"]["message"]


@pytest.mark.parametrize("body, param", [
    ('{"checkpoint": "/x", "drain_wait_s": Infinity}', None),
    ('{"checkpoint": "/x", "ready_timeout_s": NaN}', None),
    ('{"checkpoint": "/x", "drain_wait_s": 1e308}', "drain_wait_s"),
    ('{"checkpoint": "/x", "batch": 1.5}', "batch"),
    ('{"checkpoint": "/x", "bacth": 1}', "bacth"),
    ("[" * 50_000, None),
], ids=["infinity", "nan", "huge", "fractional-batch", "unknown-field", "deep"])
async def test_bad_deploy_options_are_a_400_and_start_nothing(
        fake_replicas, tiny_model, body, param):
    async with fleet(fake_replicas, tiny_model, 2) as f, \
            httpx.AsyncClient(base_url=f.base) as c:
        resp = await c.post("/admin/deploy", content=body,
                            headers={"content-type": "application/json"})
        latest = await c.get("/admin/deploy")
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param
    assert latest.status_code == 404  # no deploy was started, and the record still reads


async def test_an_oversized_admin_body_is_a_413(fake_replicas, tiny_model):
    async with fleet(fake_replicas, tiny_model, 1) as f, \
            httpx.AsyncClient(base_url=f.base) as c:
        deploy_resp = await c.post("/admin/deploy", content=b" " * (70 * 1024))
        drain_resp = await c.post("/admin/replicas/r0/drain", content=b" " * (70 * 1024))
    assert deploy_resp.status_code == drain_resp.status_code == 413


async def test_the_lock_is_renewed_while_a_slow_checkpoint_is_validated(
        fake_replicas, tiny_model, checkpoint, tmp_path, monkeypatch):
    from dpserve.rollout.validate_proc import Checker

    original = Checker.check

    async def slow_check(self, job):  # type: ignore[no-untyped-def]
        await asyncio.sleep(1.5)  # a large checkpoint: longer than the lock's time to live
        return await original(self, job)

    monkeypatch.setattr(Checker, "check", slow_check)
    lock = DeployLock(tmp_path / "deploy.lock", ttl_s=0.6)
    rival = DeployLock(tmp_path / "deploy.lock", ttl_s=0.6)
    async with fleet(fake_replicas, tiny_model, 2, deploy_lock=str(lock.path),
                     deploy_lock_ttl_s=0.6) as f:
        deploying = asyncio.create_task(deploy(f, checkpoint))
        await wait_for(lock.path.exists, "the deploy to take the lock")
        loop = asyncio.get_running_loop()
        end = loop.time() + 1.2
        while loop.time() < end:  # twice the lock's time to live: still held throughout
            with pytest.raises(Exception, match="holds the deploy lock"):
                await asyncio.to_thread(rival.acquire, "rival")
            await asyncio.sleep(0.1)
        status, record = await deploying
    assert status == 202 and record["state"] == "succeeded"


async def test_a_deploy_that_loses_its_lock_stops_and_rolls_back(
        fake_replicas, tiny_model, checkpoint, tmp_path):
    lock = DeployLock(tmp_path / "deploy.lock", ttl_s=0.6)
    gate = asyncio.Event()
    async with fleet(fake_replicas, tiny_model, 3, deploy_lock=str(lock.path),
                     deploy_lock_ttl_s=0.6, reload_gate=gate) as f:
        deploying = asyncio.create_task(deploy(f, checkpoint))
        # r0's reload is held; meanwhile another router takes the lock over.
        await wait_for(lambda: "/collective_rpc" in f.fakes[0].dev_calls, "r0's reload",
                       within_s=30)
        lock.path.write_text(json.dumps({"holder": "another-router", "deploy": "theirs",
                                         "expires_at": 4e9}))
        await wait_for(lambda: any("lock lost" in e for e in f.rollout.latest().events),
                       "the deploy to notice the lock is lost")
        gate.set()
        status, record = await deploying
    assert status == 202
    assert record["state"] == "rolled_back", record
    assert "deploy lock was lost" in record["error"]
    assert f.fakes[1].dev_calls == f.fakes[2].dev_calls == []  # no later batch started
    assert json.loads(lock.path.read_text())["holder"] == "another-router"  # left alone


def test_resume_refuses_a_training_state_that_would_run_code(tmp_path):
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):  # type: ignore[no-untyped-def]
            return (os.system, (f"touch {marker}",))

    crafted = tmp_path / "trainer.pt"
    for protocol in (2, pickle.DEFAULT_PROTOCOL):
        crafted.write_bytes(pickle.dumps({"step": 1, "optimizer": Exploit()}, protocol))
        with pytest.raises(CheckpointError, match="refusing to load it"):
            load_tensors_only(crafted, "cpu")
    assert not marker.exists()
