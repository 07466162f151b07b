"""The health loop's bookkeeping, against a fake transport that answers as scripted."""

from __future__ import annotations

import httpx

from dpserve.config import RouterConfig
from dpserve.router.health import HealthChecker
from dpserve.router.pool import Replica, ReplicaPool, ReplicaState


class ScriptedReplicaTransport(httpx.AsyncBaseTransport):
    """A fake replica: `/health` answers the next scripted status, `/v1/models` one model."""

    def __init__(self, *statuses: int) -> None:
        self.statuses = list(statuses)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "tiny"}]})
        return httpx.Response(self.statuses.pop(0))


async def check(state: ReplicaState, *statuses: int) -> tuple[Replica, list[ReplicaState]]:
    replica = Replica(id="r0", url="http://r0", state=state)
    pool = ReplicaPool([replica])
    config = RouterConfig(unhealthy_threshold=2, healthy_threshold=2)
    seen = []
    async with httpx.AsyncClient(transport=ScriptedReplicaTransport(*statuses)) as client:
        checker = HealthChecker(pool, config, client)
        for _ in statuses:
            await checker.check_all()
            seen.append(replica.state)
    return replica, seen


async def test_a_ready_replica_leaves_rotation_after_two_failed_checks_in_a_row():
    replica, seen = await check(ReplicaState.READY, 500, 200, 500, 503)
    assert seen == [ReplicaState.READY] * 3 + [ReplicaState.DOWN]
    assert replica.last_error == "2 health checks failed, last: /health answered 503"


async def test_a_down_replica_returns_after_two_good_checks_with_its_models_read():
    replica, seen = await check(ReplicaState.DOWN, 200, 500, 200, 200)
    assert seen == [ReplicaState.DOWN] * 3 + [ReplicaState.READY]
    assert replica.models == frozenset({"tiny"})
