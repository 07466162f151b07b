"""A router in front of FakeReplicas with a rollout set up as `dpserve serve` sets it up,
for tests of the rolling deploy: fakes because these cases need replicas whose reload
or canary fails on cue. Real vLLM replicas are covered in tests/integration."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import shutil
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from dpserve.config import RouterConfig
from dpserve.rollout.deployed import Deployed, weights_for
from dpserve.rollout.rollout import Rollout
from dpserve.rollout.snapshot import SnapshotStore
from dpserve.router.fleet.pool import Replica, ReplicaPool, ReplicaState
from dpserve.router.http.app import Router
from dpserve.serve import compose
from tests.conftest import serving
from tests.fakes import FakeReplica

HOT_LOAD = ["/pause?mode=keep", "/collective_rpc",
            "/reset_prefix_cache?reset_running_requests=true", "/resume",
            "/update_weight_version"]


class FakeRestarter:
    """Stands in for the supervisor: a restart 'starts' the replica on deployed.current
    (the fake stays up; the router's health loop re-admits it)."""

    def __init__(self, pool: ReplicaPool, deployed: Deployed) -> None:
        self._pool, self._deployed = pool, deployed
        self.launches = {r.id: (1, deployed.current.version) for r in pool}
        self.restarts: list[str] = []

    def launched(self, replica_id: str) -> tuple[int, str | None]:
        return self.launches[replica_id]

    async def restart(self, replica_id: str, reason: str) -> None:
        self.restarts.append(replica_id)
        count, _ = self.launches[replica_id]
        self.launches[replica_id] = (count + 1, self._deployed.current.version)
        replica = self._pool.get(replica_id)
        assert replica is not None
        replica.weight_version = self._deployed.current.version


@dataclass
class Fleet:
    base: str
    router: Router
    fakes: list[FakeReplica]
    rollout: Rollout
    deployed: Deployed
    restarter: FakeRestarter | None
    most_out_of_rotation: int = 0

    def versions(self) -> list[str | None]:
        return [r.weight_version for r in self.router.pool]

    def states(self) -> list[str]:
        return [r.state.value for r in self.router.pool]


@contextlib.asynccontextmanager
async def fleet(fake_replicas, tiny_model: Path, n: int = 2, *, supervised: bool = True,
                knows_model: bool = True, checkpoint_root: Path | None = None,
                **settings: object) -> AsyncIterator[Fleet]:
    """A router composed as `dpserve serve` composes it, in front of `n` FakeReplicas.
    `checkpoint_root` defaults to the temp directory, where tests write checkpoints;
    `settings` go to the FakeReplicas, or to RouterConfig when they name its fields."""
    router_fields = {f.name for f in dataclasses.fields(RouterConfig)}
    config_settings = {k: v for k, v in settings.items() if k in router_fields}
    fake = {k: v for k, v in settings.items() if k not in router_fields}
    fakes = [await fake_replicas(f"f{i}", **fake) for i in range(n)]
    deployed = Deployed(weights_for(str(tiny_model)))
    pool = ReplicaPool([Replica(id=f"r{i}", url=f.url, weight_version=deployed.current.version)
                        for i, f in enumerate(fakes)])
    store = Path(tempfile.mkdtemp(prefix="snapshots-"))
    config = RouterConfig(health_interval_s=0.2, snapshot_dir=str(store),
                          checkpoint_root=str(checkpoint_root or tempfile.gettempdir()),
                          **config_settings)  # type: ignore[arg-type]
    restarter = FakeRestarter(pool, deployed) if supervised else None
    router, rollout = compose(pool, deployed if knows_model else None, config,
                              restarter=restarter)
    async with serving(router) as (base, _):
        f = Fleet(base, router, fakes, rollout, deployed, restarter)

        def count(*_: object) -> None:
            out = sum(r.state is not ReplicaState.READY for r in router.pool)
            f.most_out_of_rotation = max(f.most_out_of_rotation, out)

        router.pool.on_state_change(count)
        try:
            yield f
        finally:
            await rollout.aclose()
            await asyncio.to_thread(SnapshotStore(store, keep=0).prune, [])
            await asyncio.to_thread(shutil.rmtree, store, True)


async def take_down(f: Fleet, i: int) -> Replica:
    """Fail the fake's health checks until the router's health loop marks it down."""
    f.fakes[i].healthy = False
    replica = f.router.pool.get(f"r{i}")
    assert replica is not None
    while replica.state is not ReplicaState.DOWN:
        await asyncio.sleep(0.02)
    return replica


async def deploy(f: Fleet, checkpoint: Path, **options: object) -> tuple[int, dict]:
    async with httpx.AsyncClient(base_url=f.base, timeout=30) as c:
        r = await c.post("/admin/deploy", json={"checkpoint": str(checkpoint), **options})
        if r.status_code != 202:
            return r.status_code, r.json()
        await f.rollout.wait()
        return 202, (await c.get(f"/admin/deploy/{r.json()['id']}")).json()


