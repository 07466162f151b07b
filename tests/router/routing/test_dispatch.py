"""The dispatcher's slot gives back what an attempt held exactly once, however it ends.

A slot holds a replica's in-flight count, a breaker permit and a place in the
admission queue's accounting. A leak on any path would skew load balancing
forever (a replica that looks busy) or wedge the queue; a double release would
make a busy replica look idle.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from dpserve.config import RouterConfig
from dpserve.router.fleet.breaker import Outcome
from dpserve.router.fleet.pool import Replica, ReplicaPool, ReplicaState
from dpserve.router.routing.canary import CanarySplit, stratum
from dpserve.router.routing.dispatch import Dispatcher, Unavailable
from dpserve.router.routing.policies import RequestInfo, make_policy
from tests.conftest import running_router
from tests.waiting import wait_for

REQUEST = RequestInfo(route="/v1/completions")


def dispatcher(n: int = 1, **settings: object) -> tuple[Dispatcher, ReplicaPool]:
    pool = ReplicaPool([Replica(id=f"r{i}", url=f"http://r{i}", state=ReplicaState.READY)
                        for i in range(n)])
    config = RouterConfig(**settings)  # type: ignore[arg-type]
    return Dispatcher(pool, make_policy("round-robin"), config), pool


async def test_a_slot_counts_in_flight_while_held_and_nested_slots_add_up():
    d, pool = dispatcher()
    r0 = pool.get("r0")
    with await d.choose(REQUEST, []):
        with await d.choose(REQUEST, []):
            assert r0.in_flight == 2
        assert r0.in_flight == 1
    assert r0.in_flight == 0


async def test_an_exception_releases_once_and_the_breaker_hears_the_outcome_once():
    d, pool = dispatcher(breaker_failures=2)
    r0 = pool.get("r0")
    with pytest.raises(RuntimeError), await d.choose(REQUEST, []) as slot:
        slot.outcome = Outcome.SERVER_ERROR
        raise RuntimeError("upstream failed")
    assert r0.in_flight == 0
    assert d.breaker(r0).consecutive_failures == 1


async def test_a_slot_released_early_tells_the_breaker_before_the_next_choice_and_once():
    d, pool = dispatcher(2, breaker_failures=2)
    with await d.choose(REQUEST, []) as slot:
        broken = slot.replica
        slot.outcome = Outcome.DISCONNECTED  # its stream broke mid-way
        slot.release()  # by whoever learned it: before the block ends
        assert broken.in_flight == 0
        assert d.breaker(broken).consecutive_failures == 1
        with await d.choose(REQUEST, [broken.id]) as nxt:  # the stream's next replica
            assert nxt.replica is not broken
            slot.release()  # again: nothing more
            assert nxt.replica.in_flight == 1
    assert [r.in_flight for r in pool] == [0, 0]
    assert d.breaker(broken).consecutive_failures == 1


async def test_a_slot_counts_its_adapter_while_held_and_forgets_it_when_none_is_left():
    d, pool = dispatcher()
    r0 = pool.get("r0")
    r0.models = frozenset({"tiny", "a@1", "b@1"})
    a, b = (RequestInfo(route="/v1/completions", adapter=n) for n in ("a@1", "b@1"))
    with await d.choose(a, []), await d.choose(a, []):
        with pytest.raises(RuntimeError), await d.choose(b, []):
            assert r0.adapters_in_flight == {"a@1": 2, "b@1": 1}
            raise RuntimeError("upstream failed")
        with await d.choose(REQUEST, []):
            assert r0.adapters_in_flight == {"a@1": 2}
    assert r0.adapters_in_flight == {}
    assert r0.in_flight == 0


async def test_a_cancelled_attempt_releases_once_and_wakes_a_queued_request():
    d, pool = dispatcher(max_in_flight_per_replica=1)
    r0 = pool.get("r0")
    holding = asyncio.Event()

    async def attempt() -> None:
        with await d.choose(REQUEST, []):
            holding.set()
            await asyncio.Event().wait()  # until cancelled

    first = asyncio.create_task(attempt())
    await holding.wait()
    queued = asyncio.create_task(d.choose(REQUEST, []))
    await asyncio.sleep(0)  # it is in the queue now: the replica is at its cap
    assert not queued.done() and d.queue.waiting == 1
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    slot = await asyncio.wait_for(queued, 5)
    assert r0.in_flight == 0  # the cancelled one gave its count back, once
    with slot:
        assert r0.in_flight == 1
    assert r0.in_flight == 0
    assert d.breaker(r0).consecutive_failures == 0  # a cancellation is not the replica's fault


async def test_clients_that_leave_mid_stream_leave_no_count_behind(fake_replicas):
    replica = await fake_replicas("r0", chunks=50, chunk_delay_s=0.05)
    async with running_router([replica.url]) as (url, router):
        r0 = router.pool.get("r0")
        for _ in range(5):
            reader, writer = await asyncio.open_connection("127.0.0.1", int(url.rsplit(":")[-1]))
            body = b'{"model": "fake-model", "prompt": "x", "stream": true}'
            writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: r\r\ncontent-length: %d\r\n"
                         b"\r\n%s" % (len(body), body))
            await writer.drain()
            await reader.readuntil(b"data: ")  # the stream has started
            writer.close()
        await wait_for(lambda: r0.in_flight == 0 and replica.open_streams == 0,
                       "every stream to be released")
        assert replica.closed_streams == 5


async def test_a_retry_goes_to_a_replica_not_tried_yet_and_none_is_tried_twice():
    d, _ = dispatcher(3)
    tried: list[str] = []
    for _ in range(3):
        slot = await d.choose(REQUEST, tried)
        assert slot.replica.id not in tried
        tried.append(slot.replica.id)
    with pytest.raises(Unavailable) as caught:
        await d.choose(REQUEST, tried)
    assert caught.value.status == 502
    assert sorted(tried) == ["r0", "r1", "r2"]


async def test_a_replica_to_avoid_gets_no_new_request_while_another_can_take_it():
    d, pool = dispatcher(2)
    r0, r1 = pool.get("r0"), pool.get("r1")
    r0.avoid = "loading adapter support@v2"
    chosen = [(await d.choose(REQUEST, [])).replica.id for _ in range(4)]
    assert chosen == ["r1"] * 4
    assert (await d.choose(REQUEST, ["r1"])).replica is r0  # nowhere else: it still serves
    r0.avoid = None
    assert {(await d.choose(REQUEST, [])).replica.id for _ in range(4)} == {"r0", "r1"}
    assert r1.in_flight == 0  # no slot above was entered


async def test_a_request_moving_off_a_replica_waits_for_one_coming_into_rotation():
    d, pool = dispatcher(3, queue_timeout_s=5)
    r0, r1, r2 = pool.get("r0"), pool.get("r1"), pool.get("r2")
    pool.set_state(r0, ReplicaState.DRAINING, "drained")
    pool.set_state(r1, ReplicaState.STARTING, "undrained")
    pool.set_state(r2, ReplicaState.DOWN, "failed")
    with pytest.raises(Unavailable):  # a new request: no waiting, an outage shows at once
        await d.choose(REQUEST, [])
    told: list[list[str]] = []
    chosen = asyncio.create_task(d.choose(REQUEST, ["r0"], waiting=lambda coming: told.append(
        [r.id for r in coming])))
    await wait_for(lambda: d.queue.waiting == 1, "the request waiting in the queue")
    pool.set_state(r1, ReplicaState.READY, "health checks pass")
    assert (await asyncio.wait_for(chosen, 5)).replica is r1
    assert told == [["r1"]] and d.queue.waiting == 0


async def test_a_wait_for_a_replica_coming_into_rotation_ends_with_the_queue_timeout():
    d, pool = dispatcher(2, queue_timeout_s=0.05)
    pool.set_state(pool.get("r0"), ReplicaState.RELOADING, "deploy")
    with pytest.raises(Unavailable) as caught:
        await d.choose(REQUEST, ["r1"], waiting=lambda coming: None)
    assert caught.value.status == 503
    assert caught.value.message == "no replica came into rotation within 0.05 s"
    with pytest.raises(Unavailable):  # the one coming is one it failed on: no wait
        await asyncio.wait_for(d.choose(REQUEST, ["r0", "r1"], waiting=lambda c: None), 0.5)
    assert d.could_take(REQUEST, ["r1"]) and not d.could_take(REQUEST, ["r0", "r1"])


async def test_in_a_canary_window_an_attempt_is_recorded_with_the_prefill_its_engine_did():
    """The uncached prompt tokens come from the KV events (`uncached`), and are asked for
    only while a canary window is open."""
    asked: list[tuple[str, tuple[int, ...], str | None]] = []

    def uncached(replica_id: str, tokens: Sequence[int], adapter: str | None) -> int:
        asked.append((replica_id, tuple(tokens), adapter))
        return 700

    pool = ReplicaPool([Replica(id="r0", url="http://r0", state=ReplicaState.READY)])
    d = Dispatcher(pool, make_policy("round-robin"), RouterConfig(), uncached=uncached)
    prompt = RequestInfo(route="/v1/completions", tokens=(1, 2, 3), size=5000)
    with await d.choose(prompt, []) as slot:
        slot.outcome, slot.first_byte_s = Outcome.SUCCESS, 0.1
    assert asked == [] and slot.prefill is None  # no window: nothing asked
    d.canary = CanarySplit("r0", 100, clock=lambda: 0.0)
    with await d.choose(prompt, []) as slot:
        slot.outcome, slot.first_byte_s = Outcome.SUCCESS, 0.1
    with await d.choose(REQUEST, []) as slot:  # no tokens known: by its size
        slot.outcome, slot.first_byte_s = Outcome.SUCCESS, 0.1
    assert asked == [("r0", (1, 2, 3), None)]
    assert d.canary.canary.strata == [stratum(0, 5000, 700), stratum(0, 0)]
    assert stratum(0, 5000, 700) != stratum(0, 5000)
