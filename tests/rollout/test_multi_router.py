"""Two routers in front of the same replicas, as on Kubernetes: one deploy at a time
across them (the shared lock file), and the router that did not start the deploy routes
around the replica it pauses. The replicas are FakeReplicas (tests/fakes.py) that also
answer vLLM's `/is_paused` and hold a reload until the test lets it go."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from dpserve.config import RouterConfig
from dpserve.rollout.deployed import Deployed, point_link, weights_for
from dpserve.rollout.rollout import Rollout
from dpserve.router.fleet.pool import Replica, ReplicaPool, ReplicaState
from dpserve.router.http.app import Router
from dpserve.serve import compose
from tests.conftest import serving
from tests.fakes import MODEL, FakeReplica
from tests.rollout.checkpoints import perturbed, write_variant
from tests.waiting import wait_for


@contextlib.asynccontextmanager
async def router_on(urls: list[str], link: Path, lock: Path) -> AsyncIterator[
        tuple[str, Router, Rollout]]:
    """A router set up as on Kubernetes: knows the model through the deployed link, shares
    the lock, routes around paused replicas. Its rollout exists before it starts, as in
    `dpserve router`."""
    config = RouterConfig(health_interval_s=0.1, route_around_paused=True,
                          deploy_lock=str(lock), deployed_link=str(link),
                          snapshot_dir=str(lock.parent / "snapshots"),
                          checkpoint_root="/")  # the test's checkpoint is in a temp dir
    deployed = Deployed(weights_for(str(link)))
    pool = ReplicaPool([Replica(id=f"r{i}", url=u, weight_version=deployed.current.version)
                        for i, u in enumerate(urls)])
    router, rollout = compose(pool, deployed, config)
    async with serving(router) as (url, _):
        try:
            yield url, router, rollout
        finally:
            await rollout.aclose()


@pytest.fixture(scope="module")
def checkpoint(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_variant(tiny_model, tmp_path_factory.mktemp("ckpts"), 1,
                         tensors=perturbed(0.01, seed=1))


async def test_a_deploy_is_safe_with_two_routers_in_front_of_the_same_replicas(
        tiny_model, checkpoint, tmp_path):
    fakes = [await FakeReplica(f"f{i}", reload_gate=asyncio.Event()).start()
             for i in range(2)]
    lock = tmp_path / "shared" / "deploy.lock"
    link = tmp_path / "current"  # what engines (re)start on
    link.symlink_to(tiny_model)
    urls = [f.url for f in fakes]
    try:
        async with router_on(urls, link, lock) as (a_url, a, a_rollout), \
                router_on(urls, link, lock) as (b_url, b, _), \
                httpx.AsyncClient(timeout=30) as c:
            await wait_for(lambda: len(a.pool.ready()) == len(b.pool.ready()) == 2,
                           "both routers see both replicas ready")
            started = await c.post(a_url + "/admin/deploy", json={"checkpoint": str(checkpoint)})
            assert started.status_code == 202, started.text
            await wait_for(lambda: fakes[0].paused, "router A pauses the first replica")

            # Router B was not told; it sees the pause and routes around that replica.
            await wait_for(lambda: b.pool.get("r0").state is ReplicaState.DOWN,
                           "router B takes the paused replica out")
            answers = [await c.post(b_url + "/v1/completions",
                                    json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
                       for _ in range(6)]
            assert [r.status_code for r in answers] == [200] * 6
            assert {r.headers["x-dpserve-replica"] for r in answers} == {"r1"}
            # ...and cannot start a deploy of its own meanwhile.
            second = await c.post(b_url + "/admin/deploy", json={"checkpoint": str(checkpoint)})
            assert second.status_code == 409
            assert "deploy lock" in second.json()["error"]["message"]
            assert lock.exists()

            for fake in fakes:
                assert fake.reload_gate is not None
                fake.reload_gate.set()
            await a_rollout.wait()
            assert a_rollout.latest().state.value == "succeeded"
            assert not lock.exists()  # released: the next deploy may run on any router
            snapshot = a_rollout.latest().snapshot
            assert str(link.resolve()) == snapshot  # engines restarted now load it
            assert weights_for(str(link)).version == a_rollout.latest().version
            await wait_for(lambda: len(b.pool.ready()) == 2, "router B takes both back")
            assert all(f.weights == snapshot for f in fakes)
    finally:
        for fake in fakes:
            await fake.stop()


def test_the_deployed_link_is_replaced_atomically(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    link = tmp_path / "current"
    point_link(link, tmp_path / "a")
    point_link(link, tmp_path / "b")
    assert link.resolve() == tmp_path / "b"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "current"]
