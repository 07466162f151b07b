"""A deploy's eval file (`"eval_data"`, `dpserve deploy --eval`) is named by an admin
request and read by the router: nothing named there may hang the deploy, flood the
router's memory, lead the read outside the checkpoint root, or take the threads the
data plane and /metrics need.

Each hostile file is deployed through `/admin/deploy` on a router in front of the
shared fake replicas. A refusal must come within seconds (the old code hung for good
on a FIFO, so each wait has a deadline, and every FIFO is opened from this side before
the test ends so that no reader is left stuck), and nothing may change.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from dpserve.records import DataError, read_records
from dpserve.rollout import quality
from tests.rollout.checkpoints import perturbed, write_variant
from tests.rollout.fleet import Fleet, deploy, fleet
from tests.waiting import wait_for

pytestmark = pytest.mark.timeout(60)  # a hang is the failure these tests look for

GOOD = '{"prompt": "2+2=", "completion": "4"}\n'
REFUSED_WITHIN_S = 5.0
TRIES = 6
"""Deploys tried at once: the report's six, which used up the default thread pool of
its 2-core machine (min(32, cores + 4) threads)."""


@pytest.fixture
async def two_core_default_pool() -> AsyncIterator[None]:
    """The event loop's default thread pool sized as on the reported machine, so that
    TRIES stuck threads exhaust it whatever this machine's core count."""
    pool = ThreadPoolExecutor(max_workers=TRIES)
    asyncio.get_running_loop().set_default_executor(pool)
    yield
    pool.shutdown(wait=False, cancel_futures=True)


@contextlib.contextmanager
def fifo(path: Path) -> Iterator[Path]:
    """A FIFO at `path`, no reader left stuck on it afterwards: opening it read-write
    (never blocks on Linux) lets a reader stuck in open(2) through, unlinking it stops
    new ones, and closing it ends their read(2) with EOF."""
    os.mkfifo(path)
    try:
        yield path
    finally:
        fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)
        os.unlink(path)
        os.close(fd)


def count_starts(monkeypatch: pytest.MonkeyPatch, f: Fleet) -> list[None]:
    """One entry per deploy request that reached `Rollout.start`. Everything `start` does
    before its first wait is synchronous, so once a request is counted its blocking
    admin work has been handed to a thread."""
    calls: list[None] = []
    real = f.rollout.start

    async def start(*args: Any, **kwargs: Any) -> Any:
        calls.append(None)
        return await real(*args, **kwargs)

    monkeypatch.setattr(f.rollout, "start", start)
    return calls


async def assert_the_default_pool_serves(f: Fleet) -> None:
    """Work on the loop's default pool runs, and `/metrics/engines` (which builds its
    client there) answers: the report's symptom was both hanging."""
    assert await asyncio.wait_for(asyncio.to_thread(lambda: 1), 2) == 1
    async with httpx.AsyncClient(base_url=f.base) as c:
        resp = await asyncio.wait_for(c.get("/metrics/engines"), REFUSED_WITHIN_S)
    assert resp.status_code == 200


async def assert_nothing_changed(f: Fleet, versions: list[str | None]) -> None:
    async with httpx.AsyncClient(base_url=f.base) as c:
        latest = await c.get("/admin/deploy")
    assert latest.status_code == 404  # no deploy was recorded, let alone started
    assert f.versions() == versions
    assert all(fake.dev_calls == [] for fake in f.fakes)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """The fleet's checkpoint root in these tests (a short path: a socket's name fits)."""
    (tmp_path / "root").mkdir()
    return tmp_path / "root"


@contextlib.contextmanager
def unix_socket(path: Path) -> Iterator[Path]:
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(path))
        yield path


@contextlib.contextmanager
def directory(path: Path) -> Iterator[Path]:
    path.mkdir()
    yield path


@pytest.mark.parametrize("make, kind", [
    (fifo, "a FIFO"),
    (unix_socket, "not a regular file"),
    (directory, "a directory"),
], ids=["fifo", "socket", "directory"])
async def test_an_eval_set_that_is_not_a_regular_file_is_refused_at_once(
        fake_replicas, tiny_model, root, make, kind):
    async with fleet(fake_replicas, tiny_model, 2, checkpoint_root=root) as f:
        versions = f.versions()
        with make(root / "eval.jsonl") as special:  # released before the router stops
            async with asyncio.timeout(REFUSED_WITHIN_S):
                status, body = await deploy(f, root / "step-000001", eval_data=str(special))
        await assert_nothing_changed(f, versions)
    assert status == 422, body
    assert body["error"]["param"] == "eval_data"
    message = body["error"]["message"]
    assert message.startswith(f"eval set: {special}: ") and kind in message, message
    assert "not a regular file" in message


async def test_an_eval_set_larger_than_the_cap_is_refused_naming_the_cap(
        fake_replicas, tiny_model, root):
    big = root / "big.jsonl"
    with big.open("wb") as fh:  # sparse: costs no disk, and is never read
        fh.write(GOOD.encode())
        fh.truncate(quality.MAX_EVAL_BYTES + 1)
    async with fleet(fake_replicas, tiny_model, 2, checkpoint_root=root) as f:
        versions = f.versions()
        async with asyncio.timeout(REFUSED_WITHIN_S):
            status, body = await deploy(f, root / "step-000001", eval_data=str(big))
        await assert_nothing_changed(f, versions)
    assert status == 422 and body["error"]["param"] == "eval_data", body
    assert f"{big}: {quality.MAX_EVAL_BYTES + 1} bytes, larger than the 64 MiB" in \
        body["error"]["message"]


@pytest.mark.parametrize("target", ["inside", "outside"])
async def test_an_eval_set_named_by_a_symbolic_link_is_refused_as_one(
        fake_replicas, tiny_model, tmp_path, root, target):
    """Like a checkpoint's files: a link is never followed, wherever it points (even to
    a good eval file inside the root), so what is read is the file the request named."""
    real = (root if target == "inside" else tmp_path) / "real.jsonl"
    real.write_text(GOOD)
    link = root / "eval.jsonl"
    link.symlink_to(real)
    async with fleet(fake_replicas, tiny_model, 2, checkpoint_root=root) as f:
        versions = f.versions()
        async with asyncio.timeout(REFUSED_WITHIN_S):
            status, body = await deploy(f, root / "step-000001", eval_data=str(link))
        await assert_nothing_changed(f, versions)
    assert status == 422 and body["error"]["param"] == "eval_data", body
    assert body["error"]["message"] == (
        f"eval set: {link}: a symbolic link; name the eval file itself (links are not "
        "followed, as in a checkpoint)")


async def test_deploys_naming_a_fifo_leave_the_default_pool_to_the_data_plane(
        two_core_default_pool, fake_replicas, tiny_model, root, monkeypatch):
    async with fleet(fake_replicas, tiny_model, 2, checkpoint_root=root) as f:
        starts = count_starts(monkeypatch, f)
        with fifo(root / "eval.jsonl") as special:
            tries = [asyncio.create_task(deploy(f, root / "step-000001",
                                                eval_data=str(special)))
                     for _ in range(TRIES)]
            try:
                await wait_for(lambda: len(starts) == TRIES, "every deploy to reach the rollout")
                await assert_the_default_pool_serves(f)
                async with asyncio.timeout(REFUSED_WITHIN_S):
                    answers = await asyncio.gather(*tries)
            finally:
                for task in tries:
                    task.cancel()
    assert [status for status, _ in answers] == [422] * TRIES


@contextlib.asynccontextmanager
async def deploys_stuck_reading_their_eval_set(
        f: Fleet, monkeypatch: pytest.MonkeyPatch, checkpoint: Path,
        eval_file: Path) -> AsyncIterator[tuple[list[asyncio.Task[tuple[int, dict]]],
                                                threading.Event]]:
    """TRIES deploys sent at once, each stuck reading its eval set until the event is
    set: a fake, as a regular file whose read hangs (a storage mount that stopped
    answering) cannot be made here. On the way out it is set, and the deploys are given
    time to be answered (the router stops cleanly), whatever happened."""
    release = threading.Event()
    real = quality.gate_for

    def stuck_gate_for(*args: Any, **kwargs: Any) -> quality.Gate | None:
        release.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(quality, "gate_for", stuck_gate_for)
    starts = count_starts(monkeypatch, f)
    tries = [asyncio.create_task(deploy(f, checkpoint, eval_data=str(eval_file)))
             for _ in range(TRIES)]
    try:
        await wait_for(lambda: len(starts) == TRIES, "every deploy to reach the rollout")
        yield tries, release
    finally:
        release.set()
        await asyncio.wait(tries, timeout=30)
        for task in tries:
            task.cancel()


@pytest.fixture
def checkpoint(tiny_model: Path, root: Path) -> Path:
    return write_variant(tiny_model, root, 1, tensors=perturbed(0.01, seed=1))


async def test_eval_reads_stuck_on_storage_leave_the_default_pool_to_the_data_plane(
        two_core_default_pool, fake_replicas, tiny_model, root, checkpoint, monkeypatch):
    (root / "eval.jsonl").write_text(GOOD)
    async with fleet(fake_replicas, tiny_model, 2, checkpoint_root=root) as f, \
            deploys_stuck_reading_their_eval_set(f, monkeypatch, checkpoint,
                                                 root / "eval.jsonl"):
        await assert_the_default_pool_serves(f)


async def test_deploys_sent_together_start_one_and_refuse_the_others(
        fake_replicas, tiny_model, root, checkpoint, monkeypatch):
    (root / "eval.jsonl").write_text(GOOD)
    reloads = asyncio.Event()  # holds the deploy that started, so it is still running
    async with fleet(fake_replicas, tiny_model, 2, checkpoint_root=root,
                     reload_gate=reloads) as f, \
            deploys_stuck_reading_their_eval_set(f, monkeypatch, checkpoint,
                                                 root / "eval.jsonl") as (tries, release):
        try:
            release.set()
            await wait_for(lambda: sum(t.done() for t in tries) == TRIES - 1,
                           "all but one deploy to be answered")
            refused = [t.result() for t in tries if t.done()]
        finally:
            reloads.set()
        started = await asyncio.wait_for(next(t for t in tries if not t.done()), 30)
    assert [status for status, _ in refused] == [409] * (TRIES - 1)
    assert all("one deploy at a time" in body["error"]["message"] for _, body in refused)
    assert started[0] == 202 and started[1]["state"] == "succeeded", started


async def test_training_data_named_as_a_fifo_is_a_data_error_at_once(tmp_path):
    """`dpserve finetune` reads its data the same way (`dpserve.records`)."""
    with fifo(tmp_path / "train.jsonl") as special:
        with pytest.raises(DataError, match=f"^{special}: a FIFO, not a regular file"):
            await asyncio.wait_for(asyncio.to_thread(read_records, special), 5)
