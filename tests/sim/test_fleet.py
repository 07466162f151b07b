"""A Fleet starts replicas on their own loopback ports, injects faults on demand and
stops leaving no open port and no task behind."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import socket

import aiohttp
import pytest

from dpserve.config import ConfigError
from dpserve.sim import Fault, Fleet
from tests.sim.conftest import FAST, scrape

BODY = {"prompt": "hello fleet", "max_tokens": 3}


def port_is_closed(url: str) -> bool:
    host, port = url.removeprefix("http://").split(":")
    with socket.socket() as s:
        return s.connect_ex((host, int(port))) != 0


async def test_replicas_listen_on_their_own_loopback_ports_and_answer():
    async with Fleet(n=3, config=FAST) as fleet, aiohttp.ClientSession() as s:
        assert len(set(fleet.urls)) == 3
        assert all(u.startswith("http://127.0.0.1:") for u in fleet.urls)
        for url in fleet.urls:
            async with s.post(url + "/v1/completions", json=BODY) as resp:
                assert (await resp.json())["usage"]["completion_tokens"] == 3
        assert [e.stats.requests_finished for e in fleet.engines] == [1, 1, 1]


async def test_stopping_closes_every_port_and_task_even_with_requests_open():
    async with Fleet(n=2, config=FAST) as fleet, aiohttp.ClientSession() as s:
        fleet.set_fault(1, Fault(mode="hang"))
        streaming = asyncio.create_task(s.post(fleet.urls[0] + "/v1/completions", json={
            "prompt": "long", "max_tokens": 3000, "stream": True}))
        hanging = asyncio.create_task(s.post(fleet.urls[1] + "/v1/completions", json=BODY))
        while fleet.engines[0].num_running == 0:
            await asyncio.sleep(0.005)
        await fleet.stop()
        assert all(port_is_closed(u) for u in fleet.urls)
        assert asyncio.all_tasks() - {asyncio.current_task(), streaming, hanging} == set()
        for t in (streaming, hanging):
            t.cancel()
        await asyncio.gather(streaming, hanging, return_exceptions=True)


async def test_a_given_base_port_numbers_replicas_consecutively():
    # Below Linux's ephemeral range (32768+), where busy machines hold thousands of ports.
    for base in random.Random(0).sample(range(20000, 32000, 2), 20):
        fleet = Fleet(n=2, config=FAST, base_port=base)
        try:
            await fleet.start()
        except OSError:
            continue
        try:
            assert fleet.urls == [f"http://127.0.0.1:{base}", f"http://127.0.0.1:{base + 1}"]
        finally:
            await fleet.stop()
        return
    pytest.fail("no two consecutive free ports found in 20 tries")


async def test_a_port_in_use_fails_start_and_stops_the_replicas_already_started():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        base = taken.getsockname()[1] - 1
        fleet = Fleet(n=2, config=FAST, base_port=base)
        with pytest.raises(OSError):
            await fleet.start()
    assert asyncio.all_tasks() == {asyncio.current_task()}


def test_mismatched_replica_count_and_configs_are_refused():
    with pytest.raises(ConfigError, match="n: 3"):
        Fleet(n=3, config=[FAST, FAST])


async def test_a_mixed_fleet_runs_each_replica_at_its_own_speed():
    slow = dataclasses.replace(FAST, step_base_s=0.02)
    async with Fleet(config=[FAST, slow]) as fleet, aiohttp.ClientSession() as s:
        for url in fleet.urls:
            async with s.post(url + "/v1/completions", json=BODY) as resp:
                assert resp.status == 200
        fast_e2e, slow_e2e = (e.stats.e2e.sum for e in fleet.engines)
        assert slow_e2e > 3 * fast_e2e


# --- faults -------------------------------------------------------------------------------


async def test_a_hung_replica_accepts_but_never_answers_while_health_stays_ok():
    async with Fleet(n=1, config=FAST) as fleet, aiohttp.ClientSession() as s:
        fleet.set_fault(0, Fault(mode="hang"))
        with pytest.raises(asyncio.TimeoutError):
            async with s.post(fleet.urls[0] + "/v1/completions", json=BODY,
                              timeout=aiohttp.ClientTimeout(total=0.3)):
                pass
        async with s.get(fleet.urls[0] + "/health") as resp:
            assert resp.status == 200
        fleet.clear_fault(0)
        async with s.post(fleet.urls[0] + "/v1/completions", json=BODY) as resp:
            assert resp.status == 200


async def test_an_erroring_replica_answers_its_status_in_openais_envelope():
    async with Fleet(n=2, config=FAST) as fleet, aiohttp.ClientSession() as s:
        fleet.set_fault(0, Fault(mode="error", status=503, health_status=503))
        async with s.post(fleet.urls[0] + "/v1/completions", json=BODY) as resp:
            assert resp.status == 503
            assert (await resp.json())["error"]["code"] == 503
        async with s.get(fleet.urls[0] + "/health") as resp:
            assert resp.status == 503
        async with s.post(fleet.urls[1] + "/v1/completions", json=BODY) as resp:
            assert resp.status == 200


async def test_a_stalled_stream_stops_after_its_tokens_and_stays_open():
    async with Fleet(n=1, config=FAST) as fleet, aiohttp.ClientSession() as s:
        fleet.set_fault(0, Fault(mode="stall", stall_after=2))
        async with s.post(fleet.urls[0] + "/v1/completions", json={
                "prompt": "stall", "max_tokens": 50, "stream": True}) as resp:
            events = [await resp.content.readuntil(b"\n\n") for _ in range(2)]
            assert all(e.startswith(b"data: {") for e in events)
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 0.2)
            assert not resp.content.at_eof()
        assert fleet.engines[0].num_running == 0  # the engine dropped the stalled request


async def test_a_stall_switched_on_mid_stream_stops_streams_already_flowing():
    async with Fleet(n=1, config=FAST) as fleet, aiohttp.ClientSession() as s:
        async with s.post(fleet.urls[0] + "/v1/completions", json={
                "prompt": "stall", "max_tokens": 500, "stream": True}) as resp:
            for _ in range(3):
                await resp.content.readuntil(b"\n\n")
            fleet.set_fault(0, Fault(mode="stall", stall_after=0))
            with pytest.raises(asyncio.TimeoutError):
                while True:  # what was already sent may still arrive, then nothing
                    await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 0.2)


async def test_a_slow_replica_takes_slowdown_times_longer():
    async with Fleet(n=1, config=FAST) as fleet, aiohttp.ClientSession() as s:
        fleet.set_fault(0, Fault(mode="slow", slowdown=5.0))
        async with s.post(fleet.urls[0] + "/v1/completions", json=BODY) as resp:
            assert resp.status == 200
        assert fleet.engines[0].stats.e2e.sum == pytest.approx(
            5 * (3 * FAST.step_base_s + 2 * FAST.decode_per_seq_s
                 + 4 * FAST.prefill_per_token_s), abs=0.004)


async def test_the_control_endpoint_sets_and_clears_faults_when_enabled():
    async with Fleet(n=1, config=FAST, control=True) as fleet, aiohttp.ClientSession() as s:
        url = fleet.urls[0]
        async with s.put(url + "/sim/fault", json={"mode": "error", "status": 502}) as resp:
            assert (await resp.json())["mode"] == "error"
        async with s.post(url + "/v1/completions", json=BODY) as resp:
            assert resp.status == 502
        async with s.put(url + "/sim/fault", json={"mode": "explode"}) as resp:
            assert resp.status == 400
        async with s.delete(url + "/sim/fault") as resp:
            assert (await resp.json())["mode"] == "none"
        async with s.post(url + "/v1/completions", json=BODY) as resp:
            assert resp.status == 200
    async with Fleet(n=1, config=FAST) as fleet, aiohttp.ClientSession() as s:
        async with s.put(fleet.urls[0] + "/sim/fault", json={"mode": "hang"}) as resp:
            assert resp.status in (404, 405)


async def test_metrics_count_finished_requests_and_their_tokens():
    async with Fleet(n=1, config=FAST) as fleet, aiohttp.ClientSession() as s:
        async with s.post(fleet.urls[0] + "/v1/completions", json=BODY) as resp:
            await resp.read()
        m = await scrape(fleet.urls[0])
        assert m["vllm:request_success_total{finished_reason=length}"] == 1
        assert m["vllm:generation_tokens_total"] == 3
