"""The deploy lock shared by several routers: a file with an expiry (dpserve/rollout/lock.py)."""

from __future__ import annotations

import json
import os
import time

import pytest

from dpserve.rollout.lease import Lease
from dpserve.rollout.lock import DeployLock, LockHeld, LockLost
from dpserve.rollout.progress import DeployProgress
from tests.waiting import wait_for


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def test_a_second_router_cannot_deploy_while_the_first_holds_the_lock(tmp_path):
    clock = Clock()
    a = DeployLock(tmp_path / "deploy.lock", ttl_s=60, holder="router-a", clock=clock)
    b = DeployLock(tmp_path / "deploy.lock", ttl_s=60, holder="router-b", clock=clock)
    a.acquire("d1")
    with pytest.raises(LockHeld, match=r"deploy d1 holds .* \(router router-a, for 60 s"):
        b.acquire("d2")
    a.release()
    b.acquire("d2")
    assert b.read().holder == "router-b"


def test_a_lock_its_holder_stopped_renewing_is_taken_over_after_its_ttl(tmp_path):
    clock = Clock()
    a = DeployLock(tmp_path / "deploy.lock", ttl_s=60, holder="router-a", clock=clock)
    b = DeployLock(tmp_path / "deploy.lock", ttl_s=60, holder="router-b", clock=clock)
    a.acquire("d1")
    clock.now += 59
    with pytest.raises(LockHeld):
        b.acquire("d2")
    clock.now += 2
    b.acquire("d2")
    assert b.read().deploy == "d2"
    with pytest.raises(LockLost):
        a.renew()
    a.release()  # too late: it must not remove router-b's lock
    assert b.read().holder == "router-b"
    assert sorted(os.listdir(tmp_path)) == ["deploy.lock"]


def test_renewing_pushes_the_expiry_ahead(tmp_path):
    clock = Clock()
    a = DeployLock(tmp_path / "deploy.lock", ttl_s=60, holder="router-a", clock=clock)
    b = DeployLock(tmp_path / "deploy.lock", ttl_s=60, holder="router-b", clock=clock)
    a.acquire("d1")
    for _ in range(5):
        clock.now += a.renew_every_s
        a.renew()
    with pytest.raises(LockHeld):
        b.acquire("d2")
    assert json.loads((tmp_path / "deploy.lock").read_text())["expires_at"] == clock.now + 60


def test_an_unreadable_lock_file_expires_a_ttl_after_it_was_written(tmp_path):
    path = tmp_path / "deploy.lock"
    path.write_text('{"holder": "router-a", "dep')  # its writer died mid-write
    clock = Clock()
    clock.now = path.stat().st_mtime + 10
    b = DeployLock(path, ttl_s=60, holder="router-b", clock=clock)
    with pytest.raises(LockHeld, match="unreadable"):
        b.acquire("d2")
    clock.now += 60
    b.acquire("d2")
    assert b.read().holder == "router-b"


async def test_a_deploy_whose_lock_was_taken_over_learns_why_and_leaves_the_new_holder_be(
        tmp_path):
    """The deploy's lease renews in the background; once another router holds the file
    (this one's renewals stopped for a ttl), the lease says why, the deploy's record
    says it is aborting, and ending the lease does not remove the other's lock."""
    path = tmp_path / "deploy.lock"
    lease = Lease(DeployLock(path, ttl_s=1.5, holder="router-a"))  # renewed every 0.5 s
    progress = DeployProgress(id="d1", checkpoint="ckpt", options={})
    await lease.take("d1")
    lease.keep(progress)
    path.write_text(json.dumps({"holder": "router-b", "deploy": "d2",
                                "expires_at": time.time() + 60}))  # b took it over
    await wait_for(lambda: lease.lost is not None, "the lease lost", within_s=5)
    assert "no longer held by this router" in (lease.lost or "")
    assert any("deploy lock lost" in e for e in progress.events), progress.events
    await lease.end()
    assert json.loads(path.read_text())["holder"] == "router-b"
