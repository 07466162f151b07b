"""`dpserve router --workers 2`: two processes on one port, against FakeReplicas (fakes:
the cases need a replica that streams slowly on cue; tests/integration runs vLLM)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from tests.procs import process_alive
from tests.rollout.checkpoints import perturbed, write_variant
from tests.waiting import wait_for

BODY = {"model": "fake-model", "prompt": "hello", "max_tokens": 4}


@contextlib.asynccontextmanager
async def router_with_workers(*urls: str, workers: int = 2, flags: tuple[str, ...] = (),
                             env: dict[str, str] | None = None
                             ) -> AsyncIterator[tuple[str, subprocess.Popen[str]]]:
    """`dpserve router --workers N` in front of `urls`, once both replicas are ready and
    every follower listens; `env` is added to the router's environment."""
    args = [sys.executable, "-m", "dpserve", "router", "--port", "0", "--workers",
            str(workers), "--health-interval-s", "0.2", *flags]
    for url in urls:
        args += ["--replica", url]
    proc = subprocess.Popen(  # noqa: ASYNC220 (a moment; the fixture's process is the router)
        args, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env={**os.environ, **(env or {})})
    assert proc.stderr is not None
    try:
        url = None
        deadline = time.monotonic() + 60
        while url is None and time.monotonic() < deadline:
            line = await asyncio.to_thread(proc.stderr.readline)
            assert line, "the router exited before it listened"
            found = re.search(r"router on (http://\S+) ", line)
            url = found.group(1) if found else None
        assert url is not None
        asyncio.get_running_loop().run_in_executor(None, proc.stderr.read)  # never fills
        async with httpx.AsyncClient() as client:
            await wait_for(lambda: _ready(client, url), "both replicas ready", within_s=30)
        port = int(url.rsplit(":", 1)[1])
        await wait_for(lambda: _followers_listen(proc.pid, port, workers - 1),
                       "every follower listening", within_s=30)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.to_thread(proc.wait, 30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


async def _ready(client: httpx.AsyncClient, url: str) -> bool:
    answer = await client.get(url + "/ready")
    return answer.status_code == 200 and answer.json()["replicas_ready"] == 2


def _followers_listen(pid: int, port: int, followers: int) -> bool:
    """Whether `followers` child processes of `pid` accept on `port` (the leader answers
    /ready as soon as it is up; a follower still importing takes no connection)."""
    listening = 0
    for child in _children(pid):
        with contextlib.suppress(psutil.Error):
            listening += any(c.status == psutil.CONN_LISTEN and c.laddr.port == port
                             for c in psutil.Process(child).net_connections(kind="tcp"))
    return listening == followers


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def _metric(text: str, name: str, **labels: str) -> float:
    return sum(s.value for family in text_string_to_metric_families(text)
               for s in family.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def _connection_per_request() -> httpx.AsyncClient:
    """One client whose every request opens its own connection (the kernel spreads
    connections, not requests, among the workers). One client, not one per request: a
    client's TLS context takes ~100 ms of CPU to build, and sixty of them at once held
    this loop (and the FakeReplicas on it) past the router's health-check timeout."""
    return httpx.AsyncClient(limits=httpx.Limits(max_keepalive_connections=0), timeout=30)


async def _fresh_connection_posts(url: str, n: int) -> list[httpx.Response]:
    """`n` requests at once, each on its own connection."""
    async with _connection_per_request() as client:
        return list(await asyncio.gather(
            *(client.post(url + "/v1/completions", json=BODY) for _ in range(n))))


async def test_two_workers_share_the_port_and_the_metrics_count_every_request(
        fake_replicas):
    r0, r1 = await fake_replicas("r0"), await fake_replicas("r1")
    async with router_with_workers(r0.url, r1.url) as (url, proc):
        answers = await _fresh_connection_posts(url, 60)
        assert [a.status_code for a in answers] == [200] * 60, [
            (a.status_code, a.headers.get("x-dpserve-worker"), a.text)
            for a in answers if a.status_code != 200]
        (follower,) = _children(proc.pid)

        async def counted() -> bool:
            async with httpx.AsyncClient() as client:
                text = (await client.get(url + "/metrics")).text
            return _metric(text, "dpserve_requests_total", route="/v1/completions",
                           status_class="2xx") == 60
        # followers report their metrics each second
        await wait_for(counted, "every request counted", within_s=10)
        async with httpx.AsyncClient() as client:
            text = (await client.get(url + "/metrics")).text
        served = {w: _metric(text, "dpserve_worker_requests_total", worker=w)
                  for w in ("0", "1")}
    assert served["0"] > 0 and served["1"] > 0, served  # both processes took connections
    assert sum(served.values()) == 60
    await wait_for(lambda: not process_alive(follower), "the follower to exit")  # no orphan


async def test_a_drain_waits_for_the_requests_every_worker_has_on_the_replica(
        fake_replicas):
    slow = await fake_replicas("r0", chunks=20, chunk_delay_s=0.1)  # 2 s streams
    other = await fake_replicas("r1")
    async with router_with_workers(slow.url, other.url) as (url, _):
        clients = _connection_per_request()

        async def stream(i: int) -> int:
            async with clients.stream(
                    "POST", url + "/v1/completions",
                    json={**BODY, "prompt": f"{i} hello", "stream": True}) as answer:
                async for _ in answer.aiter_bytes():
                    pass
                return answer.status_code
        streams = [asyncio.create_task(stream(i)) for i in range(24)]
        await wait_for(lambda: slow.open_streams >= 4, "streams on r0")
        on_slow = slow.open_streams
        async with httpx.AsyncClient() as client:
            text = (await client.get(url + "/metrics")).text
            assert _metric(text, "dpserve_replica_in_flight_requests", replica="r0") >= on_slow
            drained = await client.post(url + "/admin/replicas/r0/drain",
                                        json={"wait_s": 20}, timeout=30)
            open_at_answer = slow.open_streams
            after = await _fresh_connection_posts(url, 20)
        assert all(code == 200 for code in await asyncio.gather(*streams))
        await clients.aclose()
    assert drained.status_code == 200 and drained.json()["drained"] is True
    assert open_at_answer == 0  # the streams of both workers had ended
    assert {a.headers["x-dpserve-replica"] for a in after} == {"r1"}  # every worker drained


async def test_a_deploy_through_two_workers_changes_what_every_worker_serves(
        fake_replicas, tiny_model: Path, tmp_path: Path):
    r0, r1 = await fake_replicas("r0"), await fake_replicas("r1")
    checkpoint = await asyncio.to_thread(write_variant, tiny_model, tmp_path / "ft", 1,
                                         tensors=perturbed(0.01, seed=1))
    flags = ("--base-model", str(tiny_model), "--snapshot-dir", str(tmp_path / "snapshots"),
             "--checkpoint-root", str(tmp_path))
    async with router_with_workers(r0.url, r1.url, flags=flags) as (url, _), \
            httpx.AsyncClient(base_url=url, timeout=30) as client:
        started = await client.post("/admin/deploy", json={"checkpoint": str(checkpoint)})
        assert started.status_code == 202, started.text
        during: list[httpx.Response] = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            during += await _fresh_connection_posts(url, 4)  # load on both workers meanwhile
            record = (await client.get(f"/admin/deploy/{started.json()['id']}")).json()
            if record["done"]:
                break
        after = await _fresh_connection_posts(url, 30)
    assert record["state"] == "succeeded", record
    assert [a.status_code for a in during if a.status_code != 200] == []
    assert {a.headers["x-dpserve-weight-version"] for a in after} == {record["version"]}


async def test_a_follower_that_dies_is_started_again(fake_replicas):
    r0, r1 = await fake_replicas("r0"), await fake_replicas("r1")
    async with router_with_workers(r0.url, r1.url) as (url, proc):
        (first,) = _children(proc.pid)
        os.kill(first, signal.SIGKILL)
        await wait_for(lambda: [p for p in _children(proc.pid) if p != first],
                       "a new follower", within_s=15)
        answers = await _fresh_connection_posts(url, 20)
    assert [a.status_code for a in answers] == [200] * 20


async def test_followers_exit_when_their_leader_is_killed(fake_replicas):
    r0, r1 = await fake_replicas("r0"), await fake_replicas("r1")
    async with router_with_workers(r0.url, r1.url) as (_, proc):
        (follower,) = _children(proc.pid)
        proc.kill()  # no chance to stop its followers: they see the socket pair close
        await asyncio.to_thread(proc.wait)
        await wait_for(lambda: not process_alive(follower), "the follower to exit",
                       within_s=15)
