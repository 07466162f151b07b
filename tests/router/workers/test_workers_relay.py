"""Attacks sent on the socket to a follower worker of `dpserve router --workers 2`.

A follower forwards the data plane itself and relays every other request (probes,
`/metrics`, `/admin/*`, refusals) to the leader over a socket pair. That hop is one
more place where bytes could slip past the router's framing, so each test here
takes a connection the kernel gave to the follower (found by its port, not by
chance) and plays an attacker on it: vLLM's dev endpoints, ambiguous framing, a
request hidden in a relayed request's body, pipelining across the two paths,
oversized and slow input, and keys. The shared fake replica logs what reaches it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from dpserve.rollout.progress import DEFAULT_CANARY_PROMPT
from tests.fakes import FakeReplica
from tests.router.forward.test_smuggling import SLEEP, SMUGGLED, chunked
from tests.router.rawhttp import (
    Connection,
    completion,
    exchange,
    parse_responses,
    read_all,
    request,
)
from tests.router.workers.test_workers import _children, router_with_workers
from tests.waiting import wait_for

ADMIN_KEY = "admin-key-of-the-test-0123"
API_KEY = "api-key-of-the-test"
DEV_ROUTES = ["/collective_rpc", "/sleep?level=1", "/wake_up", "/reset_prefix_cache",
              "/pause", "/resume", "/v1/load_lora_adapter", "/update_weights",
              "/scale_elastic_ep"]


def clients_prompts(*replicas: FakeReplica) -> list[str]:
    """The prompts of the requests that reached `replicas`, less the router's own
    warm-up request (made before a replica enters rotation)."""
    return [r["prompt"] for replica in replicas for r in replica.requests
            if r.get("prompt") != DEFAULT_CANARY_PROMPT]


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _accepted_by(pid: int, port: int, client_port: int) -> bool:
    with contextlib.suppress(psutil.Error):
        return any(c.raddr and c.raddr.port == client_port and c.laddr.port == port
                   for c in psutil.Process(pid).net_connections(kind="tcp"))
    return False


async def follower_connection(url: str, leader: int) -> Connection:
    """A connection the follower accepted: connections are opened until the kernel gives
    one to it (it spreads them among the workers by their addresses)."""
    (follower,) = _children(leader)
    port = port_of(url)
    for _ in range(64):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        mine = writer.get_extra_info("sockname")[1]
        owner = await wait_for(lambda mine=mine: next(
            (pid for pid in (follower, leader) if _accepted_by(pid, port, mine)), None),
            "a worker to accept the connection")
        if owner == follower:
            return reader, writer
        writer.close()
    raise AssertionError("64 connections in a row went to the leader")


async def on_follower(url: str, proc_pid: int, *parts: bytes, **kwargs: Any
                      ) -> tuple[bytes, bool]:
    connection = await follower_connection(url, proc_pid)
    return await exchange(port_of(url), *parts, connection=connection, **kwargs)


async def test_attacks_on_a_follower_never_reach_a_replica(fake_replicas):
    replica = await fake_replicas("r0")
    other = await fake_replicas("r1")
    async with router_with_workers(replica.url, other.url) as (url, proc):
        # vLLM's dev endpoints: not forwarded by the follower, and the leader's app
        # (which answers what the follower relays) has no such route either.
        raw, _ = await on_follower(url, proc.pid, *(request(
            "POST", route, "content-type: application/json",
            body=b'{"method": "reload_weights"}') for route in DEV_ROUTES))
        answers = parse_responses(raw)
        assert [a.status for a in answers] == [404] * len(DEV_ROUTES)
        assert all(a.json()["error"]["message"] for a in answers)  # OpenAI's envelope
        # Ambiguous framing: refused by the follower's own front.
        smuggled_body = chunked(SLEEP)
        for framing in (("content-length: {n}", "transfer-encoding: chunked"),
                        ("transfer-encoding: chunked", "content-length: {n}"),
                        ("content-length: {n}", "content-length: 4")):
            headers = [h.format(n=len(smuggled_body)) for h in framing]
            raw, _ = await on_follower(url, proc.pid, request(
                "POST", "/admin/replicas", *headers, body=smuggled_body, length=False),
                completion("victim"))
            answers = parse_responses(raw)
            assert answers and answers[0].status in (400, 413), framing
        # A request hidden in the body of a relayed one, then a client's own request
        # on the same connection: the hidden one stays bytes of a body.
        raw, _ = await on_follower(url, proc.pid, request(
            "POST", "/admin/replicas/r9/drain", f"content-length: {len(SMUGGLED)}",
            body=SMUGGLED), completion("after the relayed one"))
        relayed, after = parse_responses(raw)
        assert relayed.status == 404 and after.status == 200
    assert replica.dev_calls == [] and other.dev_calls == []
    reached = replica.reached() + other.reached()
    assert set(reached) == {"POST /v1/completions"}
    prompts = clients_prompts(replica, other)
    assert "after the relayed one" in prompts
    assert set(prompts) <= {"after the relayed one", "victim"}


async def test_requests_pipelined_to_a_follower_are_answered_in_order_across_the_hop(
        fake_replicas):
    replica = await fake_replicas("r0")
    other = await fake_replicas("r1")
    async with router_with_workers(replica.url, other.url) as (url, proc):
        raw, _ = await on_follower(url, proc.pid, request("GET", "/health"),
                                   completion("one"), request("GET", "/ready"),
                                   request("GET", "/no/such/route"), completion("two"))
        answers = parse_responses(raw)
    assert [a.status for a in answers] == [200, 200, 200, 404, 200]
    assert answers[2].json()["replicas_ready"] == 2  # the leader's answer, relayed
    assert {answers[1].headers["x-dpserve-replica"], answers[4].headers["x-dpserve-replica"]
            } <= {"r0", "r1"}
    assert sorted(clients_prompts(replica, other)) == ["one", "two"]


@pytest.fixture
def limits(tmp_path: Path) -> Path:
    config = tmp_path / "router.yaml"
    config.write_text("router:\n  client_header_timeout_s: 1.0\n  max_header_bytes: 4096\n")
    return config


async def test_a_follower_holds_clients_to_the_limits_before_relaying(fake_replicas, limits):
    replica = await fake_replicas("r0")
    other = await fake_replicas("r1")
    async with router_with_workers(replica.url, other.url,
                                   flags=("--config", str(limits))) as (url, proc):
        # A body past what a follower relays (admin bodies are small): 413, not relayed.
        big = b'{"checkpoint": "' + b"a" * (2 * 1024 * 1024) + b'"}'
        raw, _ = await on_follower(url, proc.pid, request(
            "POST", "/admin/deploy", "content-type: application/json", body=big))
        (answer,) = parse_responses(raw)
        assert answer.status == 413 and answer.error_message
        # A head past the limit: 431 from the follower's front, connection closed.
        raw, closed = await on_follower(url, proc.pid, request(
            "GET", "/health", "x-big: " + "a" * 8192), until_closed=True)
        (answer,) = parse_responses(raw)
        assert answer.status == 431 and closed
        # A head sent a byte at a time: cut off at the header timeout.
        reader, writer = await follower_connection(url, proc.pid)
        started = time.monotonic()

        async def drip() -> None:
            with contextlib.suppress(ConnectionError):
                for byte in b"GET /metrics HTTP/1.1\r\nx-slow: " + b"a" * 100:
                    writer.write(bytes([byte]))
                    await writer.drain()
                    await asyncio.sleep(0.2)  # a slow client, on purpose

        dripping = asyncio.create_task(drip())
        try:
            raw, closed = await read_all(reader, quiet_s=None, deadline_s=5)
        finally:
            dripping.cancel()
            writer.close()
        assert closed and time.monotonic() - started < 1.0 + 3.0  # the limit, not the deadline
        (answer,) = parse_responses(raw)
        assert answer.status == 408
    assert clients_prompts(replica, other) == []


async def test_keys_are_checked_on_what_a_follower_relays_and_forwards(fake_replicas):
    replica = await fake_replicas("r0")
    other = await fake_replicas("r1")
    env = {"DPSERVE_ADMIN_KEY": ADMIN_KEY, "DPSERVE_API_KEY": API_KEY}
    async with router_with_workers(replica.url, other.url, env=env) as (url, proc):
        async def status(*headers: str, path: str = "/admin/replicas") -> int:
            raw, _ = await on_follower(url, proc.pid, request("GET", path, *headers))
            (answer,) = parse_responses(raw)
            assert ADMIN_KEY.encode() not in raw and API_KEY.encode() not in raw
            return answer.status

        assert await status() == 401
        assert await status(f"authorization: Bearer {API_KEY}") == 401  # not the admin's
        assert await status(f"authorization: Bearer {ADMIN_KEY}") == 200
        assert await status(path="/metrics") == 200  # scrapes stay open
        raw, _ = await on_follower(url, proc.pid, completion("no key"))
        assert parse_responses(raw)[0].status == 401
        raw, _ = await on_follower(url, proc.pid, completion("keyed").replace(
            b"host: router\r\n", f"host: router\r\nauthorization: Bearer {API_KEY}\r\n"
            .encode()))
        assert parse_responses(raw)[0].status == 200
    assert clients_prompts(replica, other) == ["keyed"]
    assert all("authorization" not in h  # the client's key stays in the router
               for h in replica.headers_seen + other.headers_seen)
