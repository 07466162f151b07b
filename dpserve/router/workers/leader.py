"""The leader's side of the workers: publish the table, fold in what followers report.

Counts are kept as totals where the router already reads them: a replica's
`in_flight` (and an adapter version's) on the leader is its own requests plus the
last count each follower reported, applied as a difference, so drains, policies,
`/admin` and metrics see the whole fleet's traffic with no change of their own.
A follower's table carries, per replica, the requests in flight *elsewhere* (the
total less its own), which it adds to its own count the same way.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from dpserve.router.asgi import Scope
from dpserve.router.errors import error_body
from dpserve.router.fleet.live import NONE_MOVING, Moving
from dpserve.router.fleet.pool import Replica
from dpserve.router.routing.canary import CanarySplit, Sample
from dpserve.router.routing.policies import Journal, shared_memory
from dpserve.router.telemetry.collectors import WorkerRow, WorkersCollector
from dpserve.router.workers.kv_share import LeaderShare
from dpserve.router.workers.wire import Channel, Message, adapter_table, replica_row
from dpserve.router.workers.work_table import MAX_SLOTS, WorkTable, share

log = logging.getLogger("dpserve.router")

TICK_S = 0.02
"""Longest a follower's view of the counts lags: the table and the reports are sent
this often when something changed (a state change goes out at once)."""
SETTLE_TIMEOUT_S = 5.0
"""Longest a drain waits for a follower to acknowledge it; one that does not (stuck or
gone) is logged and left out."""


@dataclass(eq=False)
class _Follower:
    worker: int
    channel: Channel
    acked: int = 0
    """The last table sequence number it applied."""
    joined: int = 0
    """The table sequence number when it was attached: its first table is no older."""
    sent: Message | None = None
    """The last table sent, less its sequence number: unchanged tables are not sent."""
    sent_seq: int = 0
    in_flight: dict[str, int] = field(default_factory=dict)
    adapters_in_flight: dict[str, int] = field(default_factory=dict)
    movable: dict[str, list[int]] = field(default_factory=dict)
    """Per replica: its streams here that would migrate, and those that would restart."""
    metrics: bytes = b""
    answered: float = 0.0
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    answering: set[asyncio.Task[None]] = field(default_factory=set)
    changed: asyncio.Event = field(default_factory=asyncio.Event)


class Leader:
    """Keeps every follower's table current and its reports counted. `app` answers the
    requests followers relay (the router's own app, its auth included)."""

    def __init__(self, router: Any, app: Any, work: WorkTable | None = None) -> None:
        self._router = router
        self._pool = router.pool
        self._app = app
        self._followers: dict[int, _Follower] = {}
        self._seq = 0
        self._memory = shared_memory(router.policy)
        self._slots: dict[str, int] = {}
        """Replica id -> its cell in the shared work table, numbered here."""
        for replica in self._pool:
            self._slot(replica)
        if self._memory is not None:
            share(self._memory, work, self._slots, on_journal=self._learned_here)
        self._canary: CanarySplit | None = None
        self._canary_epoch = 0
        self._had_ready = bool(self._pool.ready())
        self._ready_seq = 0
        """The table sequence number at which the pool last went from no ready replica
        to some: a follower that has not applied it yet would refuse every request."""
        self._pool.on_state_change(lambda *_: self._pool_changed())
        self._pool.on_membership(lambda _: self._pool_changed(),
                                 lambda _: self._pool_changed())
        router.lagging_workers = self.lagging
        self._pool.settle = self.settled
        router.adapters.settle = self.settled
        router.dispatcher.streams.peers = self
        router.metrics.others = lambda: [f.metrics for f in self._followers.values()]
        router.metrics.registry.register(WorkersCollector(self._rows))
        self._kv = LeaderShare(router, self._broadcast)

    def _pool_changed(self) -> None:
        ready = bool(self._pool.ready())
        if ready and not self._had_ready:
            self._seq += 1
            self._ready_seq = self._seq
        self._had_ready = ready
        self._changed()

    def lagging(self) -> list[int]:
        """Followers that got a table in which no replica was ready yet, while here one is,
        and have not applied a newer one: each request they take would get 503."""
        return sorted(f.worker for f in self._followers.values()
                      if f.joined < self._ready_seq and f.acked < self._ready_seq)

    def _changed(self) -> None:
        """Publish now rather than at the next tick."""
        for follower in self._followers.values():
            follower.changed.set()

    @property
    def followers(self) -> int:
        return len(self._followers)

    def _rows(self) -> list[WorkerRow]:
        elsewhere = sum(sum(f.in_flight.values()) for f in self._followers.values())
        mine = sum(r.in_flight for r in self._pool) + sum(
            r.in_flight for r in self._pool.leaving()) - elsewhere
        return [("0", self._router.metrics.answered(), mine)] + [
            (str(f.worker), f.answered, sum(f.in_flight.values()))
            for f in sorted(self._followers.values(), key=lambda f: f.worker)]

    def attach(self, worker: int, channel: Channel) -> None:
        """Serve follower `worker` on `channel` until it goes away (`detach`)."""
        follower = _Follower(worker, channel, joined=self._seq)
        self._followers[worker] = follower
        follower.tasks = [
            asyncio.create_task(self._publish(follower), name=f"dpserve-publish-{worker}"),
            asyncio.create_task(self._read(follower), name=f"dpserve-reports-{worker}"),
        ]

    async def detach(self, worker: int) -> None:
        """Forget a follower that is gone: what it had in flight no longer counts."""
        follower = self._followers.pop(worker, None)
        if follower is None:
            return
        self._apply_counts(follower.in_flight, {}, self._replica)
        self._apply_counts(follower.adapters_in_flight, {}, self._router.adapters.get)
        follower.channel.close()
        current = asyncio.current_task()
        for task in (*follower.tasks, *follower.answering):
            if task is not current:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, ConnectionError):
                    await task

    async def aclose(self) -> None:
        for worker in list(self._followers):
            await self.detach(worker)

    async def settled(self) -> None:
        """Return once every follower has applied the table as it is now (and reported
        its counts since), or SETTLE_TIMEOUT_S passed."""
        self._seq += 1
        target = self._seq
        self._changed()
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while time.monotonic() < deadline:
            if all(f.acked >= target for f in self._followers.values()):
                return
            await asyncio.sleep(TICK_S / 4)
        late = [f.worker for f in self._followers.values() if f.acked < target]
        log.warning("worker(s) %s did not acknowledge the replica table within %.0f s",
                    late, SETTLE_TIMEOUT_S)

    # LiveStreams' peers: the streams of a drained replica that run in followers.
    def movable(self, replica_id: str) -> Moving:
        moving = NONE_MOVING
        for f in self._followers.values():
            if (counts := f.movable.get(replica_id)) is not None:
                moving += Moving(*counts)
        return moving

    def evict(self, replica_id: str) -> Moving:
        for follower in self._followers.values():
            follower.channel.send({"op": "evict", "replica": replica_id})
        return self.movable(replica_id)

    def _table(self, follower: _Follower) -> Message:
        dispatcher = self._router.dispatcher
        if dispatcher.canary is not self._canary:
            self._canary = dispatcher.canary
            self._canary_epoch += 1
        canary = self._canary
        mine = follower.in_flight
        return {
            "op": "table",
            "replicas": [replica_row(r, r.in_flight - mine.get(r.id, 0), self._slot(r))
                         for r in self._pool],
            "canary": None if canary is None else {**canary.spec(),
                                                   "epoch": self._canary_epoch},
            "adapters": adapter_table(self._router.adapters),
            "peers": self._kv.table_section(),
        }

    def _learned_here(self) -> None:
        """The leader's routing memory changed: tell the followers at the end of this
        turn of the loop (what else this turn routes goes in the same message)."""
        asyncio.get_running_loop().call_soon(self._send_learned)

    def _send_learned(self) -> None:
        assert self._memory is not None
        self._share(self._memory.journal(), None)

    def _share(self, journal: Journal, source: _Follower | None) -> None:
        """Pass what one worker's routing learned to every other follower, at once: two
        workers that both route before hearing of the other's choice may pick the
        same replica, so the sooner the better (a tick's 20 ms, at 22 req/s, made
        that one request in five and p99 TTFT 16% worse)."""
        if journal["work"] or journal["homes"]:
            self._broadcast({"op": "learn", **journal}, source)

    def _broadcast(self, message: Message, source: object | None) -> None:
        """Send `message` to every follower but `source`."""
        for follower in self._followers.values():
            if follower is not source:
                follower.channel.send(message)

    async def _publish(self, follower: _Follower) -> None:
        while True:
            table = self._table(follower)
            if table != follower.sent or follower.sent_seq < self._seq:
                follower.sent, follower.sent_seq = table, self._seq
                follower.channel.send({**table, "seq": self._seq})
                try:
                    await follower.channel.drain()
                except ConnectionError:
                    return  # the follower is gone: `_read` sees the end and detaches it
            follower.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(follower.changed.wait(), TICK_S)

    async def _read(self, follower: _Follower) -> None:
        while (message := await follower.channel.recv()) is not None:
            op = message.get("op")
            if op == "report":
                self._report(follower, message)
            elif op == "learn":
                if self._memory is not None:
                    self._memory.absorb(message)
                    self._share(message, follower)
            elif op == "prompts":
                self._kv.absorb(message, follower)
            elif op == "http":
                task = asyncio.create_task(self._answer(follower, message),
                                           name=f"dpserve-relayed-{follower.worker}")
                follower.answering.add(task)
                task.add_done_callback(follower.answering.discard)
        await self.detach(follower.worker)

    def _report(self, follower: _Follower, report: Message) -> None:
        follower.acked = max(follower.acked, report["seq"])
        counts = report["in_flight"]
        self._apply_counts(follower.in_flight, counts, self._replica)
        follower.in_flight = counts
        adapters = report["adapters"]
        self._apply_counts(follower.adapters_in_flight, adapters, self._router.adapters.get)
        follower.adapters_in_flight = adapters
        follower.movable = report["movable"]
        if "metrics" in report:
            follower.metrics = report["metrics"].encode()
            follower.answered = report["answered"]
        for replica_id, reason in report["down"]:
            replica = self._pool.get(replica_id)
            if replica is not None:
                self._pool.mark_down(replica, reason)
        canary = report["canary"]
        split = self._router.dispatcher.canary
        if canary is not None and split is not None and canary["epoch"] == self._canary_epoch:
            for name, sample in split.samples().items():
                sample.add(Sample(**canary[name]))

    @staticmethod
    def _apply_counts(old: dict[str, int], new: dict[str, int], find: Any) -> None:
        for key in old.keys() | new.keys():
            delta = new.get(key, 0) - old.get(key, 0)
            if delta and (holder := find(key)) is not None:
                holder.in_flight += delta

    def _slot(self, replica: Replica) -> int | None:
        slot = self._slots.get(replica.id)
        if slot is None and len(self._slots) < MAX_SLOTS:
            slot = self._slots[replica.id] = len(self._slots)
        return slot

    def _replica(self, replica_id: str) -> Replica | None:
        return self._pool.get(replica_id) or next(
            (r for r in self._pool.leaving() if r.id == replica_id), None)

    async def _answer(self, follower: _Follower, message: Message) -> None:
        try:
            status, headers, body = await answer(self._app, message)
        except Exception:  # the app answers its own errors; this is a bug, not a reply
            log.exception("a request relayed by worker %d failed", follower.worker)
            status, headers = 500, [["content-type", "application/json"]]
            body = error_body(500, "internal router error")
        follower.channel.send({"op": "reply", "id": message["id"], "status": status,
                               "headers": headers, "body": base64.b64encode(body).decode()})


async def answer(app: Any, message: Message) -> tuple[int, list[list[str]], bytes]:
    """Run a relayed request through `app`: its status, headers and whole body."""
    s = message["scope"]
    scope: Scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": s["http_version"],
        "method": s["method"], "scheme": s["scheme"], "path": s["path"],
        "raw_path": s["path"].encode(), "query_string": s["query_string"].encode("latin-1"),
        "root_path": "", "headers": [(n.encode("latin-1"), v.encode("latin-1"))
                                     for n, v in s["headers"]],
        "client": tuple(s["client"]) if s["client"] else None,
        "server": tuple(s["server"]) if s["server"] else None, "state": {},
    }
    body = base64.b64decode(message["body"])
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            await asyncio.Event().wait()  # the client stays: nothing more to say
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    status, headers, parts = 500, [], []

    async def send(event: dict[str, Any]) -> None:
        nonlocal status, headers
        if event["type"] == "http.response.start":
            status = event["status"]
            headers = [[n.decode("latin-1"), v.decode("latin-1")]
                       for n, v in event.get("headers", [])]
        elif event["type"] == "http.response.body":
            parts.append(event.get("body", b""))

    await app(scope, receive, send)
    return status, headers, b"".join(parts)
