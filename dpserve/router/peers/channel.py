"""The channel between routers behind one address: each publishes its reports on a PUB
socket and hears the others' on one SUB socket connected to all of them.

**Finding the peers.** Each peer is `HOST:PORT`; HOST is resolved (`getaddrinfo`, in a
thread: a slow DNS server must not stall the loop) to *all* its addresses and the SUB
socket connects to each. A Kubernetes headless Service's name thus gives every router
pod, this one included (its own reports come back and are ignored by `sender`). Names
are resolved again every `resolve_every_s`: pods that appear are connected, those gone
are disconnected. A name that fails to resolve keeps the addresses it had (a DNS blip
must not cut the routers apart) and is tried again next time. ZeroMQ connects in the
background and reconnects by itself, so a peer that starts later is heard once it is up.

**Losses.** Reports are absolute (in-flight counts) or decay (work), so a lost report
is repaired by the next one; nothing is retransmitted. Sends never block: the PUB
socket drops a subscriber's messages past `SEND_HWM` (libzmq does so silently and
counts nothing; its `XPUB_NODROP` would count, but then one stalled subscriber would
stop the reports to every peer).

**Security review.** Reports are signed (HMAC-SHA256, `dpserve.router.peers.wire`),
not encrypted. The SUB socket only connects out, to what the peer names resolve to.

- Someone who reaches the peer port without the key cannot be heard: a PUB socket
  drops all a subscriber sends bar subscriptions (at most `MAX_SUBSCRIPTION_BYTES`
  each). If they are at an address a peer name resolves to, each message is counted
  as rejected and costs one HMAC over at most 1 MiB (0.6 ms). They *can* read the
  reports (replica URLs, loads, and prompts' chain keys, which tell whether a guessed
  prompt was sent lately), have up to `SEND_HWM` reports queued for a connection that
  never reads, and hold subscriptions while connected. Admit only router pods to the
  port (a NetworkPolicy).
- A holder of the key (or a buggy peer) can skew routing within the wire's bounds:
  claim load on replicas (up to 1,000,000 in flight and 1e9 work on each of 1,024) or
  prompts never sent. It cannot stop the receive loop (a bad report is `BadReport`, a
  raising callback is counted) nor make one message cost more than its 1 MiB.
- Memory held by ZeroMQ: up to `RECEIVE_HWM` messages per connected address, so
  100 MiB at 1 MiB each (a real report is a few KiB). libzmq also buffers a multipart
  message whole, with no limit on its frame count, before handing it over: a process
  at an address a peer name resolves to could exhaust memory with one endless message.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import zmq
import zmq.asyncio

from dpserve.router.peers.wire import (
    MAX_PAYLOAD_BYTES,
    MIN_KEY_BYTES,
    PROTOCOL,
    SENDER_BYTES,
    BadReport,
    PeerReport,
    decode,
    encode,
)

log = logging.getLogger("dpserve.router")

RECEIVE_HWM = 100
"""Messages queued unread per connected address before ZeroMQ drops: a report goes
every 10 ms at most, so a second of one peer's; bounds what a process at a peer's
address can make the router hold at 100 MiB."""
SEND_HWM = 1000
"""Reports queued per subscriber before it loses them: a few seconds' worth."""
MAX_FRAME_BYTES = MAX_PAYLOAD_BYTES + 64
"""ZeroMQ drops a connection that sends a larger frame, before this code sees it."""
MAX_SUBSCRIPTION_BYTES = 64
"""Largest message a subscriber may send the PUB socket (a subscription is the
14-byte protocol): a larger one drops that connection."""
LOG_EVERY_S = 60.0
"""At most one warning per reason (or per name) in this time: a flood of bad messages
is counted, not written to the log."""


@dataclass(slots=True)
class ChannelStats:
    """Counters since `start`, for `/metrics` and the admin API."""

    sent: int = 0
    """Reports handed to the PUB socket."""
    dropped: int = 0
    """Reports the PUB socket refused (it drops per subscriber silently; see above)."""
    received: int = 0
    """Peers' reports accepted (this router's own are ignored, not counted)."""
    rejected: dict[str, int] = field(default_factory=dict)
    """Messages refused, by `BadReport.reason`: "size", "mac" or "format"."""
    callback_errors: int = 0
    """Accepted reports whose `on_report` raised."""
    connected: tuple[str, ...] = ()
    """The endpoints the SUB socket is connected to now (`tcp://ADDRESS:PORT`)."""
    resolve_errors: int = 0
    """Lookups of a peer name that failed."""


def split_address(address: str) -> tuple[str, int]:
    """`HOST:PORT` (an IPv6 HOST in brackets) as (HOST without brackets, PORT)."""
    host, sep, port = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"peer address {address!r}: an IPv6 address needs brackets, "
                         "as in [::1]:5560")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"peer address {address!r} is not HOST:PORT")
    return host, int(port)


def endpoint(host: str, port: int) -> str:
    """The ZeroMQ endpoint of `host` (an IPv6 address gets brackets) and `port`."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class PeerChannel:
    """Publishes this router's reports and hands its peers' to `on_report`, on the loop."""

    def __init__(self, *, bind: str | None, peers: Sequence[str], key: bytes,
                 on_report: Callable[[PeerReport], None], sender: bytes,
                 resolve_every_s: float = 10.0) -> None:
        if len(key) < MIN_KEY_BYTES:
            raise ValueError(f"peer key of {len(key)} bytes; at least {MIN_KEY_BYTES} needed")
        if len(sender) != SENDER_BYTES:
            raise ValueError(f"sender of {len(sender)} bytes, not {SENDER_BYTES}")
        if not resolve_every_s > 0:
            raise ValueError(f"resolve_every_s must be > 0, got {resolve_every_s}")
        self._bind = bind
        self._bind_at = None if bind is None else split_address(bind)
        self._peers = {address: split_address(address) for address in peers}
        self._key = key
        self._on_report = on_report
        self._sender = sender
        self._resolve_every_s = resolve_every_s
        self._stats = ChannelStats()
        self._context: zmq.asyncio.Context | None = None
        self._pub: zmq.Socket[bytes] | None = None
        self._sub: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._resolved: dict[str, set[str]] = {}
        self._logged_at: dict[str, float] = {}
        self._closed = False

    @property
    def stats(self) -> ChannelStats:
        """A snapshot of the counters."""
        return replace(self._stats, rejected=dict(self._stats.rejected))

    async def start(self) -> None:
        """Bind the PUB socket (if `bind`), then listen and resolve in the background.
        OSError naming the address if it cannot be bound."""
        if self._context is not None or self._closed:
            raise RuntimeError("a PeerChannel starts once")
        self._context = zmq.asyncio.Context()
        sub = self._sub = self._context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
        sub.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        sub.setsockopt(zmq.IPV6, 1)  # IPv4 addresses connect as well
        sub.subscribe(PROTOCOL)
        if self._bind_at is not None:
            # A plain socket: sends never wait, so nothing here needs the loop.
            pub = self._pub = zmq.Socket(self._context, zmq.PUB)
            pub.setsockopt(zmq.LINGER, 0)
            pub.setsockopt(zmq.SNDHWM, SEND_HWM)
            pub.setsockopt(zmq.MAXMSGSIZE, MAX_SUBSCRIPTION_BYTES)
            pub.setsockopt(zmq.IPV6, 1)  # "*" listens on IPv6 and IPv4
            try:
                pub.bind(endpoint(*self._bind_at))
            except zmq.ZMQError as e:
                self._close_sockets()
                raise OSError(e.errno, f"peer channel cannot bind {self._bind}: "
                                       f"{e.strerror}") from None
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._receive_forever(), name="dpserve-peers-receive"),
                       loop.create_task(self._resolve_forever(), name="dpserve-peers-resolve")]

    def publish(self, report: PeerReport) -> None:
        """Send `report` to every subscribed peer now, or drop it; never waits.
        ValueError (from `encode`) for a report out of the wire's bounds."""
        if self._pub is None:
            raise RuntimeError("publish needs a started PeerChannel with `bind` set")
        frames = encode(report, self._key)
        try:
            self._pub.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            self._stats.dropped += 1
        else:
            self._stats.sent += 1

    async def aclose(self) -> None:
        """Stop both tasks and close the sockets, dropping what is queued. Idempotent."""
        self._closed = True
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._sub):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._sub = None
        if self._context is not None:
            self._context.term()
            self._context = None

    async def _receive_forever(self) -> None:
        assert self._sub is not None
        try:
            while True:
                self._handle(await self._sub.recv_multipart())
                await asyncio.sleep(0)  # a flood's next message waits its turn
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("peer channel: receiving stopped; peers' reports are no longer heard")

    def _handle(self, frames: list[bytes]) -> None:
        try:
            report = decode(frames, self._key)
        except BadReport as e:
            rejected = self._stats.rejected
            rejected[e.reason] = rejected.get(e.reason, 0) + 1
            if self._may_log(f"reason:{e.reason}"):
                log.warning("peer channel: message rejected (%s): %s; %d so far",
                            e.reason, e, rejected[e.reason])
            return
        if report.sender == self._sender:
            return  # our own, back through a name that resolves to every router
        self._stats.received += 1
        try:
            self._on_report(report)
        except Exception:
            self._stats.callback_errors += 1
            if self._may_log("callback"):
                log.exception("peer channel: on_report raised (%d so far)",
                              self._stats.callback_errors)

    async def _resolve_forever(self) -> None:
        try:
            while True:
                await self._resolve()
                await asyncio.sleep(self._resolve_every_s)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("peer channel: resolving stopped; the peers known now are kept")

    async def _resolve(self) -> None:
        """Connect to every address the peer names have now, and from no other."""
        found = await asyncio.gather(*(self._lookup(name, host, port)
                                       for name, (host, port) in self._peers.items()))
        for name, endpoints in zip(self._peers, found, strict=True):
            if endpoints is not None:
                self._resolved[name] = endpoints
        wanted: set[str] = set().union(*self._resolved.values())
        connected = set(self._stats.connected)
        assert self._sub is not None
        for gone in connected - wanted:
            with contextlib.suppress(zmq.ZMQError):  # already gone: nothing to undo
                self._sub.disconnect(gone)
            connected.discard(gone)
        for new in wanted - connected:
            try:  # connecting is local (ZeroMQ dials in the background): only a bad address fails
                self._sub.connect(new)
                connected.add(new)
            except zmq.ZMQError as e:
                self._stats.resolve_errors += 1
                if self._may_log("connect"):
                    log.warning("peer channel: cannot connect to %s: %s", new, e)
        self._stats.connected = tuple(sorted(connected))

    async def _lookup(self, name: str, host: str, port: int) -> set[str] | None:
        """The endpoints `host` resolves to now; None (counted, logged) if it does not."""
        try:
            infos = await asyncio.to_thread(socket.getaddrinfo, host, port,
                                            type=socket.SOCK_STREAM)
        except (OSError, UnicodeError) as e:
            self._stats.resolve_errors += 1
            if self._may_log(f"name:{name}"):
                log.warning("peer channel: cannot resolve %s: %s; retrying every %g s",
                            name, e, self._resolve_every_s)
            return None
        return {endpoint(str(info[4][0]), port) for info in infos}

    def _may_log(self, what: str) -> bool:
        """Whether to log `what` now: at most once per `LOG_EVERY_S`."""
        now = time.monotonic()
        last = self._logged_at.get(what)
        if last is not None and now - last < LOG_EVERY_S:
            return False
        self._logged_at[what] = now
        return True
