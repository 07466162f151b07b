from __future__ import annotations

import asyncio

import pytest

from dpserve.router.fleet.pool import Replica
from dpserve.router.routing.admission import (
    Admission,
    AdmissionQueue,
    QueueFull,
    QueueTimeout,
    decide,
    ewma,
    free_slots,
    retry_after_s,
    under_cap,
)


def replicas(*loads: int) -> list[Replica]:
    return [Replica(id=f"r{i}", url=f"http://r{i}", in_flight=n) for i, n in enumerate(loads)]


def test_only_replicas_under_their_cap_take_more():
    assert [r.id for r in under_cap(replicas(4, 2, 3), 3)] == ["r1"]
    assert len(under_cap(replicas(400, 2), None)) == 2


def test_free_slots_add_up_the_room_left_on_each_replica():
    assert free_slots(replicas(4, 2, 0), 3) == 4  # 0 + 1 + 3, an over-cap replica is not negative
    assert free_slots(replicas(9, 9), None) == 2
    assert free_slots([], None) == 0


@pytest.mark.parametrize(("free", "waiting", "max_waiting", "decision"), [
    (1, 0, 10, Admission.ADMIT),
    (5, 1, 10, Admission.QUEUE),   # someone is ahead: no jumping the line
    (0, 0, 10, Admission.QUEUE),
    (0, 9, 10, Admission.QUEUE),
    (0, 10, 10, Admission.REJECT),
    (0, 0, 0, Admission.REJECT),   # no line at all
])
def test_decide(free, waiting, max_waiting, decision):
    assert decide(free, waiting, max_waiting) is decision


def test_retry_after_is_the_time_for_the_line_ahead_to_drain():
    assert retry_after_s(9, slots=4, mean_service_s=2.0) == 5      # 10 * 2 / 4
    assert retry_after_s(0, slots=8, mean_service_s=0.1) == 1      # never below the floor
    assert retry_after_s(999, slots=1, mean_service_s=30.0) == 60  # nor above the ceiling
    assert retry_after_s(0, slots=0, mean_service_s=1.0) == 60     # nothing ready


def test_ewma_starts_at_the_first_sample_and_moves_a_fraction_toward_each_next():
    assert ewma(None, 2.0) == 2.0
    assert ewma(2.0, 4.0, alpha=0.25) == 2.5


class Slots:
    """Room the test hands out by hand, standing in for replicas' in-flight caps."""

    def __init__(self, free: int = 0) -> None:
        self.free = free

    def __call__(self) -> int:
        return self.free

    def take(self) -> None:
        self.free -= 1


async def settle() -> None:
    """Let every ready task run until it blocks (no timing involved)."""
    for _ in range(5):
        await asyncio.sleep(0)


async def enter(queue: AdmissionQueue, slots: Slots, log: list[str], name: str) -> None:
    await queue.acquire(slots)
    slots.take()  # the lease, taken before the next await
    log.append(name)


async def test_a_request_starts_at_once_when_there_is_room_and_no_line():
    queue, slots = AdmissionQueue(max_waiting=4, timeout_s=5), Slots(1)
    await asyncio.wait_for(queue.acquire(slots), 1)
    assert queue.waiting == 0


async def test_a_full_line_refuses_at_once():
    queue, slots = AdmissionQueue(max_waiting=1, timeout_s=5), Slots(0)
    waiter = asyncio.create_task(queue.acquire(slots))
    await settle()
    with pytest.raises(QueueFull) as refused:
        await queue.acquire(slots)
    assert refused.value.waiting == 1
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)


async def test_waiters_get_in_first_come_first_served_as_slots_free():
    queue, slots, log = AdmissionQueue(max_waiting=4, timeout_s=5), Slots(0), []
    tasks = [asyncio.create_task(enter(queue, slots, log, n)) for n in ("a", "b", "c")]
    await settle()
    assert queue.waiting == 3
    slots.free = 1
    queue.notify()
    await settle()
    assert log == ["a"] and queue.waiting == 2
    slots.free = 2
    queue.notify()
    await asyncio.wait_for(asyncio.gather(*tasks), 1)
    assert log == ["a", "b", "c"] and queue.waiting == 0


async def test_a_newcomer_does_not_overtake_the_line_when_a_slot_frees():
    queue, slots, log = AdmissionQueue(max_waiting=4, timeout_s=5), Slots(0), []
    first = asyncio.create_task(enter(queue, slots, log, "first"))
    await settle()
    slots.free = 1
    late = asyncio.create_task(enter(queue, slots, log, "late"))
    queue.notify()
    await settle()
    assert log == ["first"]
    late.cancel()
    await asyncio.gather(first, late, return_exceptions=True)


async def test_a_wake_without_room_keeps_the_waiter_at_the_head():
    queue, slots, log = AdmissionQueue(max_waiting=4, timeout_s=5), Slots(0), []
    tasks = [asyncio.create_task(enter(queue, slots, log, n)) for n in ("a", "b")]
    await settle()
    queue.notify()  # nothing actually freed
    await settle()
    assert log == [] and queue.waiting == 2
    slots.free = 1
    queue.notify()
    await settle()
    assert log == ["a"]
    tasks[1].cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_woken_waiter_that_gives_up_passes_its_turn_on():
    queue, slots, log = AdmissionQueue(max_waiting=4, timeout_s=5), Slots(0), []
    quitter = asyncio.create_task(enter(queue, slots, log, "quitter"))
    patient = asyncio.create_task(enter(queue, slots, log, "patient"))
    await settle()
    slots.free = 1
    queue.notify()     # wakes the quitter...
    quitter.cancel()   # ...which leaves before it runs
    await asyncio.wait_for(patient, 1)
    assert log == ["patient"]
    assert quitter.cancelled()


async def test_a_request_that_waits_too_long_is_refused_and_leaves_the_line():
    queue, slots = AdmissionQueue(max_waiting=4, timeout_s=0.01), Slots(0)
    with pytest.raises(QueueTimeout):
        await queue.acquire(slots)
    assert queue.waiting == 0
    slots.free = 1
    await asyncio.wait_for(queue.acquire(slots), 1)  # the line is empty again


def test_nonsense_settings_are_refused():
    with pytest.raises(ValueError, match="max_waiting"):
        AdmissionQueue(max_waiting=-1, timeout_s=1)
    with pytest.raises(ValueError, match="timeout_s"):
        AdmissionQueue(max_waiting=1, timeout_s=0)
