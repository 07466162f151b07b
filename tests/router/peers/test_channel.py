"""Peer channels over real ZeroMQ on loopback: routers hear each other and not
themselves, a stranger's messages are counted and dropped, names resolve to every
address, late peers are heard, and nothing outlives `aclose`.

A PUB socket drops what it sends before a subscriber's subscription has arrived (the
slow joiner), so a test that waits for a report publishes again each time it looks."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import socket
from collections.abc import AsyncIterator, Callable

import pytest

from dpserve.replicas.launcher import free_port
from dpserve.router.peers.channel import PeerChannel, split_address
from dpserve.router.peers.wire import PeerReport
from tests.waiting import wait_for

KEY = b"shared-key-of-the-routers"
URL = "http://10.0.0.1:8000"


def report(sender: bytes, seq: int = 0) -> PeerReport:
    return PeerReport(sender=sender, seq=seq, in_flight={URL: seq}, work={URL: 1.0},
                      pending=((URL, 16, (seq, -seq)),))


class Router:
    """One router's end of the channel, keeping what it hears."""

    def __init__(self, *, bind: str | None, peers: list[str], key: bytes = KEY,
                 on_report: Callable[[PeerReport], None] | None = None,
                 resolve_every_s: float = 10.0) -> None:
        self.sender = os.urandom(16)
        self.heard: list[PeerReport] = []
        self.seq = 0
        self.channel = PeerChannel(bind=bind, peers=peers, key=key, sender=self.sender,
                                   on_report=on_report or self.heard.append,
                                   resolve_every_s=resolve_every_s)

    def publish(self) -> None:
        self.channel.publish(report(self.sender, self.seq))
        self.seq += 1

    def heard_from(self, other: Router) -> list[PeerReport]:
        return [r for r in self.heard if r.sender == other.sender]


@contextlib.asynccontextmanager
async def started(*routers: Router) -> AsyncIterator[None]:
    try:
        for router in routers:
            await router.channel.start()
        yield
    finally:
        for router in routers:
            await router.channel.aclose()


async def until_heard(listener: Router, speaker: Router, what: str) -> None:
    def heard() -> bool:
        speaker.publish()
        return bool(listener.heard_from(speaker))

    await wait_for(heard, what)


async def test_two_routers_hear_each_other_and_not_themselves() -> None:
    pa, pb = free_port(), free_port()
    a = Router(bind=f"127.0.0.1:{pa}", peers=[f"127.0.0.1:{pb}", f"127.0.0.1:{pa}"])
    b = Router(bind=f"127.0.0.1:{pb}", peers=[f"127.0.0.1:{pa}"])
    async with started(a, b):
        await until_heard(a, b, "a to hear b")
        await until_heard(b, a, "b to hear a")
        seqs = [r.seq for r in b.heard_from(a)]
        assert seqs == sorted(seqs) and b.heard_from(a)[-1] == report(a.sender, seqs[-1])
        assert a.heard_from(a) == []  # connected to itself, yet its own are ignored
        assert f"tcp://127.0.0.1:{pa}" in a.channel.stats.connected
        assert a.channel.stats.rejected == {} and a.channel.stats.received == len(a.heard)
        assert b.channel.stats.sent == b.seq


async def test_a_publisher_with_another_key_is_rejected_as_mac_and_logged_once(
        caplog: pytest.LogCaptureFixture) -> None:
    port = free_port()
    stranger = Router(bind=f"127.0.0.1:{port}", peers=[], key=b"not-the-shared-key!!")
    listener = Router(bind=None, peers=[f"127.0.0.1:{port}"])

    def rejected_many() -> bool:
        stranger.publish()
        return listener.channel.stats.rejected.get("mac", 0) >= 20

    async with started(stranger, listener):
        await wait_for(rejected_many, "the stranger's reports to be rejected")
        assert listener.heard == [] and listener.channel.stats.received == 0
        assert set(listener.channel.stats.rejected) == {"mac"}
    warnings = [r for r in caplog.records if "rejected" in r.getMessage()]
    assert len(warnings) == 1 and URL not in warnings[0].getMessage()


async def test_a_peer_name_resolves_to_its_addresses_and_is_connected() -> None:
    port = free_port()
    expected = {f"tcp://[{info[4][0]}]:{port}" if info[0] == socket.AF_INET6
                else f"tcp://{info[4][0]}:{port}"
                for info in socket.getaddrinfo("localhost", port, type=socket.SOCK_STREAM)}
    speaker = Router(bind=f"127.0.0.1:{port}", peers=[])
    listener = Router(bind=None, peers=[f"localhost:{port}"])
    async with started(speaker, listener):
        await wait_for(lambda: set(listener.channel.stats.connected) == expected,
                       f"the listener to connect to {expected}")
        await until_heard(listener, speaker, "the listener to hear localhost")


async def test_a_name_that_does_not_resolve_is_counted_and_retried() -> None:
    listener = Router(bind=None, peers=["no-such-router.invalid:5560"], resolve_every_s=0.05)
    async with started(listener):
        await wait_for(lambda: listener.channel.stats.resolve_errors >= 2,
                       "two failed lookups")
        assert listener.channel.stats.connected == ()


async def test_an_ipv6_peer_is_connected_in_brackets() -> None:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
            port = probe.getsockname()[1]
    except OSError:
        pytest.skip("no IPv6 loopback here")
    speaker = Router(bind=f"[::1]:{port}", peers=[])
    listener = Router(bind=None, peers=[f"[::1]:{port}"])
    async with started(speaker, listener):
        await until_heard(listener, speaker, "the listener to hear [::1]")
        assert listener.channel.stats.connected == (f"tcp://[::1]:{port}",)


async def test_a_peer_that_starts_after_the_listener_is_still_heard() -> None:
    port = free_port()
    listener = Router(bind=None, peers=[f"127.0.0.1:{port}"])
    late = Router(bind=f"127.0.0.1:{port}", peers=[])
    async with started(listener):
        await wait_for(lambda: listener.channel.stats.connected, "the listener to connect")
        async with started(late):
            await until_heard(listener, late, "the listener to hear the late peer")


async def test_a_raising_callback_does_not_stop_later_reports() -> None:
    heard: list[PeerReport] = []

    def flaky(r: PeerReport) -> None:
        heard.append(r)
        if len(heard) <= 2:
            raise RuntimeError("a bug in the state module")

    port = free_port()
    speaker = Router(bind=f"127.0.0.1:{port}", peers=[])
    listener = Router(bind=None, peers=[f"127.0.0.1:{port}"], on_report=flaky)

    def past_the_errors() -> bool:
        speaker.publish()
        return len(heard) > 3

    async with started(speaker, listener):
        await wait_for(past_the_errors, "reports after the callback raised")
        assert listener.channel.stats.callback_errors == 2


async def test_aclose_leaves_no_tasks_and_may_be_called_again() -> None:
    before = asyncio.all_tasks()
    router = Router(bind=f"127.0.0.1:{free_port()}", peers=["localhost:1"])
    await router.channel.start()
    assert len(asyncio.all_tasks() - before) == 2
    await router.channel.aclose()
    await router.channel.aclose()
    assert asyncio.all_tasks() == before
    with pytest.raises(RuntimeError):
        router.publish()


async def test_binding_an_address_in_use_names_the_address() -> None:
    port = free_port()
    address = f"127.0.0.1:{port}"
    async with started(Router(bind=address, peers=[])):
        second = Router(bind=address, peers=[])
        with pytest.raises(OSError, match=re.escape(address)):
            await second.channel.start()
        await second.channel.aclose()


@pytest.mark.parametrize("address", ["nohost", "host:", ":5560", "host:0", "host:65536",
                                     "::1:5560", "host:port"])
def test_an_address_not_host_port_is_refused_when_built(address: str) -> None:
    with pytest.raises(ValueError, match=r"HOST:PORT|brackets"):
        split_address(address)
    with pytest.raises(ValueError):
        PeerChannel(bind=None, peers=[address], key=KEY, on_report=print, sender=b"s" * 16)


def test_a_short_key_is_refused_when_built() -> None:
    with pytest.raises(ValueError, match="at least 16"):
        PeerChannel(bind=None, peers=[], key=b"short", on_report=print, sender=b"s" * 16)


async def test_names_are_resolved_again_and_a_failed_lookup_keeps_the_last_addresses(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """DNS cannot be made to change here, so a fake resolver (a dict) stands for it."""
    answers: dict[str, list[str]] = {"routers": ["10.0.0.1", "10.0.0.2"]}

    def fake_getaddrinfo(host: str, port: int, **_: object) -> list[tuple[object, ...]]:
        if host not in answers:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "",
                 (a, port)) for a in answers[host]]

    monkeypatch.setattr(socket, "getaddrinfo", fake_getaddrinfo)
    listener = Router(bind=None, peers=["routers:5560"], resolve_every_s=0.02)

    def connected() -> set[str]:
        return set(listener.channel.stats.connected)

    async with started(listener):
        await wait_for(lambda: connected() == {"tcp://10.0.0.1:5560", "tcp://10.0.0.2:5560"},
                       "both pods connected")
        answers["routers"] = ["10.0.0.2", "fd00::3"]
        await wait_for(lambda: connected() == {"tcp://10.0.0.2:5560", "tcp://[fd00::3]:5560"},
                       "the vanished pod dropped and the new one connected")
        del answers["routers"]
        errors = listener.channel.stats.resolve_errors
        await wait_for(lambda: listener.channel.stats.resolve_errors > errors + 2,
                       "failed lookups")
        assert connected() == {"tcp://10.0.0.2:5560", "tcp://[fd00::3]:5560"}
