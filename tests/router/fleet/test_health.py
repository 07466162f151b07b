"""The health loop's bookkeeping, against a fake transport that answers as scripted."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from dpserve.config import RouterConfig
from dpserve.router.fleet.health import HealthChecker
from dpserve.router.fleet.pool import Replica, ReplicaPool, ReplicaState
from tests.conftest import running_router
from tests.waiting import wait_for


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
            await checker.admitted()
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


class HealthyReplicas(httpx.AsyncBaseTransport):
    """Fake replicas: `/health` answers 200 unless the host is in `failing`."""

    def __init__(self) -> None:
        self.failing: set[str] = set()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "tiny"}]})
        return httpx.Response(500 if request.url.host in self.failing else 200)


async def test_a_slow_admission_holds_neither_the_other_replicas_nor_the_next_checks():
    slow, quick = (Replica(id=i, url=f"http://{i}", state=ReplicaState.STARTING)
                   for i in ("slow", "quick"))
    pool = ReplicaPool([slow, quick])
    warmed = asyncio.Event()
    admitted: list[str] = []

    async def admit(replica: Replica) -> str | None:
        if replica is slow:
            await warmed.wait()  # an engine paying its first request's set-up
        admitted.append(replica.id)
        return None

    config = RouterConfig(unhealthy_threshold=2, healthy_threshold=1)
    async with httpx.AsyncClient(transport=HealthyReplicas()) as client:
        checker = HealthChecker(pool, config, client, admit=admit)
        await checker.check_all()
        await wait_for(lambda: quick.state is ReplicaState.READY, "the quick one admitted")
        await checker.check_all()  # a later round runs meanwhile, starts no second admission
        assert slow.state is ReplicaState.STARTING and admitted == ["quick"]
        warmed.set()
        await checker.admitted()
    assert slow.state is ReplicaState.READY and admitted == ["quick", "slow"]


@pytest.mark.parametrize("problem", [None, "warm-up request failed: HTTP 500"])
async def test_a_replica_failing_while_it_was_admitted_stays_out(problem):
    replica = Replica(id="r0", url="http://r0", state=ReplicaState.DOWN)
    transport = HealthyReplicas()
    release = asyncio.Event()

    async def admit(r: Replica) -> str | None:
        await release.wait()
        return problem

    config = RouterConfig(unhealthy_threshold=2, healthy_threshold=1)
    async with httpx.AsyncClient(transport=transport) as client:
        checker = HealthChecker(ReplicaPool([replica]), config, client, admit=admit)
        await checker.check_all()
        transport.failing.add("r0")
        await checker.check_all()
        release.set()
        await checker.admitted()
    assert replica.state is ReplicaState.DOWN
    assert replica.last_error == (problem or "/health answered 500")


async def probe(replica: Replica, *statuses: int) -> list[str]:
    """Run one check per status on `replica` (in its pool); the replicas whose failed
    checks were counted, in order."""
    pool = ReplicaPool([replica])
    counted: list[str] = []
    config = RouterConfig(unhealthy_threshold=2, healthy_threshold=2)
    async with httpx.AsyncClient(transport=ScriptedReplicaTransport(*statuses)) as client:
        checker = HealthChecker(pool, config, client, on_failure=lambda r: counted.append(r.id))
        for _ in statuses:
            await checker.check_all()
            await checker.admitted()
    return counted


async def test_checks_failing_while_a_replica_starts_are_not_counted_as_failures():
    replica = Replica(id="r0", url="http://r0")  # starting: its engine is loading
    assert await probe(replica, 503, 503, 503, 200, 200) == []
    assert replica.state is ReplicaState.READY


async def test_checks_failing_once_a_replica_has_served_are_counted_until_it_restarts():
    replica = Replica(id="r0", url="http://r0")
    counted = await probe(replica, 200, 200, 500, 500, 500)  # ready, then down: an outage
    assert counted == ["r0"] * 3 and replica.state is ReplicaState.DOWN
    ReplicaPool([replica]).set_state(replica, ReplicaState.STARTING, "restarted")
    assert await probe(replica, 503, 503) == []  # the restarted engine loading again


async def test_a_replica_back_in_rotation_shows_no_last_error():
    replica, seen = await check(ReplicaState.READY, 500, 500, 200, 200)
    assert seen == [ReplicaState.READY, ReplicaState.DOWN, ReplicaState.DOWN,
                    ReplicaState.READY]
    assert replica.last_error is None


async def test_a_ready_replica_whose_check_passes_again_shows_no_last_error():
    replica, seen = await check(ReplicaState.READY, 500, 200)
    assert seen == [ReplicaState.READY] * 2
    assert replica.last_error is None


async def test_the_admin_api_and_the_counter_show_only_failures_after_start(fake_replicas):
    loading = await fake_replicas("a", healthy=False)  # an engine still loading
    async with running_router([loading.url], unhealthy_threshold=2) as (base, router), \
            httpx.AsyncClient() as c:
        replica = router.pool.get("r0")
        await wait_for(lambda: replica.last_error == "/health answered 503", "a failed probe")
        loading.healthy = True
        await wait_for(lambda: replica.state is ReplicaState.READY, "r0 ready")
        assert 'dpserve_health_check_failures_total{replica="r0"} 0.0' in (
            await c.get(base + "/metrics")).text
        assert (await c.get(base + "/admin/replicas")).json()["replicas"][0][
            "last_error"] is None
        loading.healthy = False  # it fails now: counted, and shown
        await wait_for(lambda: replica.state is ReplicaState.DOWN, "r0 down")
        listed = (await c.get(base + "/admin/replicas")).json()["replicas"][0]
        metrics = (await c.get(base + "/metrics")).text
    assert listed["last_error"].startswith("2 health checks failed")
    assert 'dpserve_health_check_failures_total{replica="r0"} 0.0' not in metrics
