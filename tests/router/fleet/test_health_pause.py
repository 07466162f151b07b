"""Health checks that route around a replica another router's deploy has paused."""

from __future__ import annotations

import httpx

from dpserve.config import RouterConfig
from dpserve.router.fleet.health import PAUSED, HealthChecker
from dpserve.router.fleet.pool import Replica, ReplicaPool, ReplicaState


class PausableReplicaTransport(httpx.AsyncBaseTransport):
    """A fake replica: healthy; `/is_paused` answers `paused` (404 if None: no dev mode)."""

    def __init__(self) -> None:
        self.paused: bool | None = False
        self.paths: list[str] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.paths.append(request.url.path)
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "tiny"}]})
        if request.url.path == "/is_paused":
            if self.paused is None:
                return httpx.Response(404, json={"detail": "Not Found"})
            return httpx.Response(200, json={"is_paused": self.paused})
        return httpx.Response(200)


async def checks(transport: PausableReplicaTransport, script: list[bool | None], *,
                 route_around_paused: bool = True, ours: bool = False,
                 ) -> tuple[Replica, list[ReplicaState]]:
    replica = Replica(id="r0", url="http://r0", state=ReplicaState.READY)
    pool = ReplicaPool([replica])
    config = RouterConfig(unhealthy_threshold=3, healthy_threshold=2,
                          route_around_paused=route_around_paused)
    seen = []
    async with httpx.AsyncClient(transport=transport) as client:
        checker = HealthChecker(pool, config, client, own_pause=lambda r: ours)
        for paused in script:
            transport.paused = paused
            await checker.check_all()
            await checker.admitted()
            seen.append(replica.state)
    return replica, seen


async def test_a_paused_replica_leaves_rotation_at_once_and_returns_once_resumed():
    transport = PausableReplicaTransport()
    replica, seen = await checks(transport, [False, True])
    assert seen == [ReplicaState.READY, ReplicaState.DOWN]  # out on the first sight
    assert replica.last_error == PAUSED
    replica, seen = await checks(transport, [True, True, False, False])
    down, ready = ReplicaState.DOWN, ReplicaState.READY
    assert seen == [down, down, down, ready]  # back after 2 good checks once resumed
    assert replica.last_error is None  # a pause it is out of is no current problem


async def test_a_replica_paused_by_this_routers_own_deploy_is_left_to_it():
    _, seen = await checks(PausableReplicaTransport(), [True, True], ours=True)
    assert seen == [ReplicaState.READY] * 2


async def test_an_engine_without_dev_endpoints_counts_as_not_paused():
    _, seen = await checks(PausableReplicaTransport(), [None, None])
    assert seen == [ReplicaState.READY] * 2


async def test_without_the_option_is_paused_is_never_asked():
    transport = PausableReplicaTransport()
    _, seen = await checks(transport, [True, True], route_around_paused=False)
    assert seen == [ReplicaState.READY] * 2 and "/is_paused" not in transport.paths
