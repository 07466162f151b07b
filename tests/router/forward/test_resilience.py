"""Retries, circuit breakers, admission and affinity through the real router,
against FakeReplicas (see tests/fakes.py) that fail on cue."""

from __future__ import annotations

import asyncio
import time

import httpx

from dpserve.router.fleet.breaker import BreakerState
from tests.conftest import running_router
from tests.fakes import MODEL
from tests.waiting import wait_for

BODY = {"model": MODEL, "prompt": "hi", "max_tokens": 4}


async def test_a_503_from_one_replica_is_retried_on_another(fake_replicas):
    bad, good = await fake_replicas("bad", mode="error503"), await fake_replicas("good")
    async with (running_router([bad.url, good.url], policy="round-robin") as (base, _),
                httpx.AsyncClient() as c):
        answers = [await c.post(base + "/v1/completions", json=BODY) for _ in range(4)]
        metrics = (await c.get(base + "/metrics")).text
    assert [a.status_code for a in answers] == [200] * 4
    assert {a.headers["x-dpserve-replica"] for a in answers} == {"r1"}
    assert len(bad.requests) >= 2  # round-robin sent it some, each one retried on r1
    assert 'dpserve_request_retries_total{route="/v1/completions"} ' in metrics


async def test_a_500_is_passed_through_not_retried(fake_replicas):
    bad, good = await fake_replicas("bad", mode="error500"), await fake_replicas("good")
    async with (running_router([bad.url, good.url], policy="round-robin") as (base, _),
                httpx.AsyncClient() as c):
        answers = [await c.post(base + "/v1/completions", json=BODY) for _ in range(2)]
    assert sorted(a.status_code for a in answers) == [200, 500]
    failed = next(a for a in answers if a.status_code == 500)
    assert failed.json()["error"]["message"] == "bad says no"  # the replica's own error
    assert len(good.requests) == 1


async def test_when_every_replica_answers_503_the_client_gets_the_last_answer(fake_replicas):
    a, b = await fake_replicas("a", mode="error503"), await fake_replicas("b", mode="error503")
    async with (running_router([a.url, b.url], max_attempts=2) as (base, _),
                httpx.AsyncClient() as c):
        r = await c.post(base + "/v1/completions", json=BODY)
    assert r.status_code == 503
    assert r.json()["error"]["message"].endswith("says no")  # passed through, not invented
    assert len(a.requests) == len(b.requests) == 1


async def test_5xx_opens_the_breaker_and_a_probe_closes_it_once_the_replica_recovers(
        fake_replicas):
    flaky, good = await fake_replicas("flaky", mode="error500"), await fake_replicas("good")
    settings = {"policy": "round-robin", "breaker_failures": 3, "breaker_cooldown_s": 0.3}
    async with (running_router([flaky.url, good.url], **settings) as (base, router),
                httpx.AsyncClient() as c):
        breaker = router.dispatcher.breaker(router.pool.get("r0"))
        for _ in range(6):  # round-robin: 3 of them reach the flaky replica
            await c.post(base + "/v1/completions", json=BODY)
        assert breaker.state(time.monotonic()) is BreakerState.OPEN
        metrics = (await c.get(base + "/metrics")).text
        assert 'dpserve_replica_breaker_state{replica="r0",state="open"} 1.0' in metrics
        assert 'dpserve_replica_breaker_state{replica="r1",state="closed"} 1.0' in metrics
        seen = len(flaky.requests)
        served = [(await c.post(base + "/v1/completions", json=BODY)) for _ in range(4)]
        assert len(flaky.requests) == seen  # open: nothing sent to it
        assert [r.status_code for r in served] == [200] * 4
        assert router.pool.get("r0").state.value == "ready"  # health still passes

        flaky.mode = "ok"

        async def served_while_closing() -> bool:
            if breaker.state(time.monotonic()) is BreakerState.CLOSED:
                return True
            r = await c.post(base + "/v1/completions", json=BODY)
            assert r.status_code == 200
            return False

        await wait_for(served_while_closing, "the breaker to close", within_s=5)
        assert len(flaky.requests) == seen + 1  # one probe, after the cooldown


async def test_a_flood_of_400s_never_opens_the_breaker(fake_replicas):
    picky = await fake_replicas("picky", mode="error400")
    async with (running_router([picky.url], breaker_failures=2) as (base, router),
                httpx.AsyncClient() as c):
        answers = [await c.post(base + "/v1/completions", json=BODY) for _ in range(20)]
        breaker = router.dispatcher.breaker(router.pool.get("r0"))
        state = breaker.state(time.monotonic())
    assert [a.status_code for a in answers] == [400] * 20
    assert len(picky.requests) == 20  # every one reached the replica
    assert state is BreakerState.CLOSED


async def test_a_replica_dropping_the_connection_is_retried_elsewhere(fake_replicas):
    dropper, good = await fake_replicas("dropper", mode="drop"), await fake_replicas("good")
    async with (running_router([dropper.url, good.url], policy="round-robin") as (base, _),
                httpx.AsyncClient() as c):
        answers = [await c.post(base + "/v1/completions", json=BODY) for _ in range(4)]
    assert [a.status_code for a in answers] == [200] * 4
    assert len(dropper.requests) >= 1


async def test_full_replicas_queue_requests_then_refuse_with_retry_after(fake_replicas):
    slow = await fake_replicas("slow", chunks=5, chunk_delay_s=0.1)
    settings = {"max_in_flight_per_replica": 1, "queue_size": 1, "queue_timeout_s": 10}
    stream = {**BODY, "stream": True}
    async with (running_router([slow.url], **settings) as (base, router),
                httpx.AsyncClient(timeout=10) as c):
        first = asyncio.create_task(c.post(base + "/v1/completions", json=stream))
        await wait_for(lambda: router.pool.get("r0").in_flight == 1, "the first request")
        second = asyncio.create_task(c.post(base + "/v1/completions", json=stream))
        await wait_for(lambda: router.dispatcher.queue.waiting == 1, "the second to queue")
        refused = await c.post(base + "/v1/completions", json=stream)
        assert slow.open_streams == 1  # the cap holds: one at a time on the replica
        assert "dpserve_queue_depth 1.0" in (await c.get(base + "/metrics")).text
        done = await asyncio.gather(first, second)
        metrics = (await c.get(base + "/metrics")).text
    assert refused.status_code == 429
    assert 'dpserve_queue_wait_seconds_count{route="/v1/completions"} 3.0' in metrics
    assert int(refused.headers["retry-after"]) >= 1
    assert refused.json()["error"]["type"] == "TooManyRequestsError"
    assert [d.status_code for d in done] == [200, 200]
    assert all(d.text.endswith("data: [DONE]\n\n") for d in done)


async def test_a_request_waiting_too_long_in_the_queue_is_refused(fake_replicas):
    stuck = await fake_replicas("stuck", mode="hang")
    settings = {"max_in_flight_per_replica": 1, "queue_timeout_s": 0.3}
    async with (running_router([stuck.url], **settings) as (base, router),
                httpx.AsyncClient(timeout=10) as c):
        hung = asyncio.create_task(c.post(base + "/v1/completions", json=BODY))
        await wait_for(lambda: router.pool.get("r0").in_flight == 1, "the hung request")
        waited = await c.post(base + "/v1/completions", json=BODY)
        hung.cancel()
    assert waited.status_code == 429
    assert "within 0.3 s" in waited.json()["error"]["message"]
    assert "retry-after" in waited.headers


async def test_no_ready_replica_is_a_503_with_retry_after(fake_replicas):
    down = await fake_replicas("down", healthy=False)
    async with running_router([down.url]) as (base, _), httpx.AsyncClient() as c:
        r = await c.post(base + "/v1/completions", json=BODY)
        metrics = (await c.get(base + "/metrics")).text
    assert r.status_code == 503 and "retry-after" in r.headers
    assert down.requests == []
    assert 'dpserve_health_check_failures_total{replica="r0"}' in metrics


async def test_session_affinity_keeps_a_session_on_one_replica(fake_replicas):
    replicas = [await fake_replicas(f"f{i}") for i in range(4)]
    async with (running_router([r.url for r in replicas], policy="session-affinity")
                as (base, _), httpx.AsyncClient() as c):
        by_header = {(await c.post(base + "/v1/completions", json=BODY,
                                   headers={"x-session-id": "alice"})).headers[
                                       "x-dpserve-replica"] for _ in range(6)}
        by_user = {(await c.post(base + "/v1/completions", json={**BODY, "user": "bob"})
                    ).headers["x-dpserve-replica"] for _ in range(6)}
        sessions = {(await c.post(base + "/v1/completions", json=BODY,
                                  headers={"x-session-id": f"s{i}"})).headers[
                                      "x-dpserve-replica"] for i in range(40)}
    assert len(by_header) == 1 and len(by_user) == 1
    assert len(sessions) >= 3  # different sessions spread over the fleet


async def test_prefix_affinity_sends_a_shared_prefix_to_one_replica(fake_replicas):
    replicas = [await fake_replicas(f"f{i}") for i in range(4)]
    system = "You are a helpful assistant for the accounting team. " * 8
    async with (running_router([r.url for r in replicas], policy="prefix-affinity",
                               prefix_chars=128) as (base, _), httpx.AsyncClient() as c):
        same = {(await c.post(base + "/v1/completions",
                              json={**BODY, "prompt": system + f"question {i}"})
                 ).headers["x-dpserve-replica"] for i in range(8)}
    assert len(same) == 1


async def test_engine_scrapes_are_stored_with_the_router_in_flight_count_of_that_instant():
    from dpserve.config import RouterConfig
    from dpserve.router.fleet.health import EngineScraper
    from dpserve.router.fleet.pool import Replica, ReplicaPool, ReplicaState

    texts = {
        "a": 'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
             'vllm:num_requests_waiting{engine="0",model_name="m"} 7.0\n'
             'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5\n',
        "b": "",  # answers 500 below: keeps no scrape
    }

    def answer(request: httpx.Request) -> httpx.Response:
        host = request.url.host
        return httpx.Response(200, text=texts["a"]) if host == "a" else httpx.Response(500)

    pool = ReplicaPool([Replica(id="a", url="http://a", state=ReplicaState.READY),
                        Replica(id="b", url="http://b", state=ReplicaState.READY)])
    a, b = pool.get("a"), pool.get("b")
    async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
        a.in_flight = 2  # two requests of the router's own on it at the scrape
        await EngineScraper(pool, RouterConfig(), client).scrape_all()
    assert (a.engine.num_requests_running, a.engine.num_requests_waiting,
            a.engine.kv_cache_usage_perc) == (3, 7, 0.5)
    assert a.engine_in_flight_at_scrape == 2 and a.engine_scraped_at is not None
    assert b.engine is None
