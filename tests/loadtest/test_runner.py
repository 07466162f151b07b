"""The load loop against the scripted fake server: schedule, cap, bounds, warm-up."""

import asyncio
import time

from loadtest.client import Payload, build_body
from loadtest.fakes import Script
from loadtest.metrics import peak_concurrency
from loadtest.runner import LoadPlan, run_load


def plan(server, offsets, **kw):
    body = build_body("completions", model="fake-model", prompt="x", max_tokens=4,
                      stream=True, ignore_eos=True, extra_body={})
    return LoadPlan(url=server.url + "/v1/completions", payloads=[Payload(body, 1, 4)],
                    offsets=offsets, **kw)


async def test_requests_are_sent_on_schedule(fake_server):
    server = await fake_server(Script(itl_s=0.001))
    offsets = [0.0, 0.05, 0.1, 0.15, 0.2]
    outcome = await run_load(plan(server, offsets))
    assert [r.scheduled_s for r in outcome.records] == offsets
    # Sent on time: no request early, none late by more than a busy machine's
    # scheduling noise (the schedule's own step is 50 ms).
    assert all(0 <= r.start_s - r.scheduled_s < 0.04 for r in outcome.records)
    assert all(r.ok for r in outcome.records)
    assert outcome.duration_s >= 0.2


async def test_max_concurrency_caps_requests_in_flight(fake_server):
    server = await fake_server(Script(ttft_s=0.03, itl_s=0.005))
    outcome = await run_load(plan(server, [0.0] * 12, max_concurrency=3))
    records = outcome.records
    assert len(records) == 12 and all(r.ok for r in records)
    assert peak_concurrency((r.start_s, r.end_s) for r in records) == 3
    # A request waited for a slot: its queue time shows it, its TTFT does not.
    assert max(r.start_s - r.scheduled_s for r in records) > 0.08
    assert max(r.ttft_s for r in records) < 0.07


async def test_duration_stops_sending_new_requests(fake_server):
    server = await fake_server(Script(itl_s=0.001))
    started = time.perf_counter()
    outcome = await run_load(plan(server, [i * 0.05 for i in range(200)], duration_s=0.5))
    assert time.perf_counter() - started < 5.0  # the full schedule would take 10 s
    assert 9 <= len(outcome.records) <= 11  # due at 0, 0.05, ..., 0.5 s
    assert all(r.scheduled_s <= 0.5 for r in outcome.records)


async def test_a_closed_loop_with_a_duration_ends_on_time(fake_server):
    server = await fake_server(Script(ttft_s=0.01, itl_s=0.002))
    outcome = await run_load(plan(server, [0.0] * 100_000, max_concurrency=4, duration_s=0.4))
    # The whole schedule would take minutes; the run stops sending at 0.4 s and ends
    # with the requests then in flight (bounds loose for a busy machine).
    assert 4 <= len(outcome.records) < 400
    assert outcome.duration_s < 3.0


async def test_warm_up_requests_are_sent_first_and_not_recorded(fake_server):
    server = await fake_server()
    outcome = await run_load(plan(server, [0.0, 0.0], num_warmups=3, max_concurrency=2))
    assert len(outcome.records) == 2
    assert server.received == 5


async def test_a_hung_request_ends_at_its_timeout_and_the_run_goes_on(fake_server):
    server = await fake_server(Script(faults={0: "hang"}))
    started = time.perf_counter()
    outcome = await run_load(plan(server, [0.0, 0.01, 0.02], request_timeout_s=0.3))
    # The hung request never answers: without its timeout the run would never end. The
    # bound is far above 0.3 s (a busy CI machine took 2 s) and far below forever.
    assert time.perf_counter() - started < 20
    assert sorted(str(r.error) for r in outcome.records) == ["None", "None", "timeout"]


async def test_request_ids_number_the_requests(fake_server):
    server = await fake_server()
    outcome = await run_load(plan(server, [0.0, 0.0], request_id_prefix="run7-"))
    assert [r.request_id for r in outcome.records] == ["run7-0", "run7-1"]


async def test_a_stop_event_ends_the_run_and_lets_requests_in_flight_finish(fake_server):
    server = await fake_server(Script(ttft_s=0.01, itl_s=0.01))
    stop = asyncio.Event()
    running = asyncio.create_task(run_load(plan(server, [i * 0.02 for i in range(10_000)],
                                                stop=stop)))
    deadline = time.monotonic() + 30
    while server.received < 5 and time.monotonic() < deadline:  # under way
        await asyncio.sleep(0.01)
    stop.set()
    sent = server.received
    outcome = await asyncio.wait_for(running, timeout=10)
    # The schedule would send 10,000 over 200 s; only those already on their way follow.
    assert 5 <= len(outcome.records) <= sent + 3
    assert all(r.ok and r.finish_reason == "length" for r in outcome.records)


async def test_with_several_urls_requests_go_to_each_in_turn(fake_server):
    a, b = await fake_server(Script(itl_s=0.001)), await fake_server(Script(itl_s=0.001))
    p = plan(a, [0.0, 0.01, 0.02, 0.03, 0.04], num_warmups=2,
             other_urls=[b.url + "/v1/completions"])
    assert [p.url_for(i) for i in range(3)] == [a.url + "/v1/completions",
                                                b.url + "/v1/completions",
                                                a.url + "/v1/completions"]
    outcome = await run_load(p)
    assert all(r.ok for r in outcome.records)
    assert (a.received, b.received) == (1 + 3, 1 + 2)  # a warm-up each, then 0,2,4 and 1,3
