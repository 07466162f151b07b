"""A follower's side of the workers: apply the leader's table, report, relay the rest.

What a follower relays costs it no more memory than the one-process router would
hold: a request the leader would refuse without reading its body (a caller without
the key, a path with no route) is refused here, unread; only `/admin` requests carry
a body to the leader, read within the admin limit and held against the router's
body budget (`max_inflight_body_bytes`) as the data plane's are (`follower_app`).

A follower's pool is a mirror: its replicas are added, removed and change state
only as the leader's table says, except that a replica its own requests find
unreachable is marked down here at once (as with one worker) and reported, so the
leader takes it out everywhere. Its `in_flight` counts are totals like the
leader's: its own requests (held by the dispatcher's slots, as always) plus the
table's count elsewhere, applied as a difference.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import itertools
import logging
import time
from typing import Any

from starlette.datastructures import URL

from dpserve.router.asgi import Receive, Scope, Send
from dpserve.router.errors import RouterError, error_body
from dpserve.router.fleet.pool import Replica, ReplicaState
from dpserve.router.forward.request import ClientGone, read_body
from dpserve.router.http.admin_body import MAX_ADMIN_BODY_BYTES
from dpserve.router.http.app import FORWARDED_ROUTES, Router, build_data_plane
from dpserve.router.http.auth import OPEN_PATHS, authenticate, is_admin_path
from dpserve.router.routing.canary import CanarySplit
from dpserve.router.routing.policies import shared_memory
from dpserve.router.workers.kv_share import FollowerShare
from dpserve.router.workers.leader import TICK_S
from dpserve.router.workers.wire import (
    Channel,
    Message,
    apply_adapter_table,
    apply_row,
    new_replica,
)
from dpserve.router.workers.work_table import WorkTable, share

log = logging.getLogger("dpserve.router")

METRICS_EVERY_S = 1.0
"""How often a follower sends its own metrics; the leader's /metrics lags this much."""
FORWARDED_PATHS = frozenset(path for path, _ in FORWARDED_ROUTES)
"""The forwarded routes' paths, whatever the method (a wrong one is the leader's 405)."""


class Follower:
    def __init__(self, router: Router, channel: Channel,
                 work: WorkTable | None = None) -> None:
        self._router = router
        self._pool = router.pool
        self._channel = channel
        self._elsewhere: dict[str, int] = {}
        self._seq = 0
        self._applying = False
        self._down: list[list[str]] = []
        self._canary_epoch: int | None = None
        self._adapters: Message | None = None
        self._pending: dict[int, asyncio.Future[Message]] = {}
        self._ids = itertools.count()
        self._sent: Message | None = None
        self._metrics_at = 0.0
        self._memory = shared_memory(router.policy)
        self._slots: dict[str, int] = {}
        if self._memory is not None:
            share(self._memory, work, self._slots, on_journal=self._learned_here)
        self._kv = FollowerShare(router, channel.send)
        self.has_table = asyncio.Event()
        """Set once the first table is applied: the follower may route."""
        self.closed = asyncio.Event()
        """Set when the leader is gone or asked this worker to stop."""
        self._pool.on_state_change(self._state_changed)

    async def run(self) -> None:
        """Apply tables and send reports until the leader closes the channel."""
        reporting = asyncio.create_task(self._report_loop(), name="dpserve-report")
        try:
            while (message := await self._channel.recv()) is not None:
                op = message.get("op")
                if op == "table":
                    self._apply(message)
                    self._report(force=True)
                elif op == "learn":
                    if self._memory is not None:
                        self._memory.absorb(message)
                elif op == "prompts":
                    self._kv.absorb(message)
                elif op == "evict":
                    self._router.dispatcher.streams.evict(message["replica"])
                elif op == "reply":
                    future = self._pending.pop(message["id"], None)
                    if future is not None and not future.done():
                        future.set_result(message)
                elif op == "stop":
                    break
        finally:
            self.closed.set()
            self._channel.close()
            reporting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reporting
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(ConnectionError("the leader worker is gone"))

    async def relay(self, scope: Scope, body: bytes) -> Message:
        """Have the leader answer a request; its reply (status, headers, body)."""
        if self.closed.is_set():
            raise ConnectionError("the leader worker is gone")
        request_id = next(self._ids)
        future: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        client, server = scope.get("client"), scope.get("server")
        self._channel.send({"op": "http", "id": request_id, "body": base64.b64encode(
            body).decode(), "scope": {
            "http_version": scope.get("http_version", "1.1"), "method": scope["method"],
            "scheme": scope.get("scheme", "http"), "path": scope["path"],
            "query_string": scope.get("query_string", b"").decode("latin-1"),
            "headers": [[n.decode("latin-1"), v.decode("latin-1")]
                        for n, v in scope["headers"]],
            "client": list(client) if client else None,
            "server": list(server) if server else None}})
        try:
            return await future
        finally:
            self._pending.pop(request_id, None)

    def _apply(self, table: Message) -> None:
        rows = {row["id"]: row for row in table["replicas"]}
        self._applying = True
        try:
            for replica in list(self._pool):
                if replica.id not in rows:
                    replica.in_flight -= self._elsewhere.pop(replica.id, 0)
                    self._pool.remove(replica.id, "left the pool")
            for replica_id, row in rows.items():
                found = self._pool.get(replica_id)
                if found is None:
                    found = new_replica(row)
                    self._pool.add(found)
                replica = found
                if row["slot"] is not None:
                    self._slots[replica_id] = row["slot"]
                state = apply_row(replica, row)
                replica.in_flight += row["elsewhere"] - self._elsewhere.get(replica_id, 0)
                self._elsewhere[replica_id] = row["elsewhere"]
                self._pool.set_state(replica, state)
        finally:
            self._applying = False
        dispatcher = self._router.dispatcher
        canary = table["canary"]
        epoch = None if canary is None else canary["epoch"]
        if epoch != self._canary_epoch:
            self._canary_epoch = epoch
            dispatcher.canary = None if canary is None else CanarySplit.from_spec(canary)
        self._kv.apply(table["peers"])
        if table["adapters"] != self._adapters:
            self._adapters = table["adapters"]
            apply_adapter_table(self._router.adapters, table["adapters"])
        self._seq = table["seq"]
        self.has_table.set()

    def _learned_here(self) -> None:
        asyncio.get_running_loop().call_soon(self._send_learned)

    def _send_learned(self) -> None:
        """What this worker's routing learned this turn, to the leader (who passes it on)."""
        assert self._memory is not None
        journal = self._memory.journal()
        if journal["work"] or journal["homes"]:
            self._channel.send({"op": "learn", **journal})

    def _state_changed(self, replica: Replica, old: ReplicaState, new: ReplicaState) -> None:
        if not self._applying and new is ReplicaState.DOWN:
            self._down.append([replica.id, replica.last_error or "unreachable"])

    async def _report_loop(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            self._report(force=False)

    def _report(self, *, force: bool) -> None:
        replicas = [*self._pool, *self._pool.leaving()]
        streams = self._router.dispatcher.streams
        report: Message = {
            "op": "report", "seq": self._seq,
            "in_flight": {r.id: n for r in replicas
                          if (n := r.in_flight - self._elsewhere.get(r.id, 0))},
            "adapters": {v.engine_name: v.in_flight
                         for v in self._router.adapters.versions() if v.in_flight},
            "movable": {rid: [n.migrating, n.restarting] for rid in streams.replicas()
                        if (n := streams.movable(rid))},
            "down": self._down,
            "canary": self._canary_samples(),
        }
        now = time.monotonic()
        if now - self._metrics_at >= METRICS_EVERY_S:
            self._metrics_at = now
            self._router.refresh_gauges()
            report["metrics"] = self._router.metrics.render().decode()
            report["answered"] = self._router.metrics.answered()
        elif not force and report == self._sent:
            return
        self._sent = report
        self._down = []
        self._channel.send(report)

    def _canary_samples(self) -> Message | None:
        split = self._router.dispatcher.canary
        if split is None or not any(s.requests for s in split.samples().values()):
            return None
        return {"epoch": self._canary_epoch,
                **{name: dataclasses.asdict(s) for name, s in split.take_samples().items()}}


def leader_has_route(path: str) -> bool:
    """Whether the leader's app answers `path` with anything but its 404 "no route".

    Its routes are the open probes, the forwarded routes (a wrong method on one is its
    405) and the control plane, all of which (deploy's routes included) lives under
    `/admin`. Starlette also redirects a path whose trailing slashes, added or
    stripped, would match a route (`/health/` is a 307 to `/health`): such a path is
    the leader's to answer too."""
    bare = path.rstrip("/")
    return is_admin_path(path) or bare in OPEN_PATHS or bare in FORWARDED_PATHS


def follower_app(router: Router, follower: Follower) -> Any:
    """The follower's ASGI app: the router's data plane; every other request (probes,
    metrics, admin, 404s and 405s) answered by the leader, or refused here when the
    leader would refuse it without reading its body.

    Contract on bodies: only an `/admin` request's body goes to the leader, read whole
    (at most MAX_ADMIN_BODY_BYTES: 413, before reading when Content-Length says so)
    while holding `router.bodies` until the leader's reply is back (503 + Retry-After
    when the budget is spent), so N clients sending bodies cost a follower what they
    cost the one-process router. Every other request the leader answers without
    reading a body (its probes, its 405s and redirects take none), so none is read
    here: it is relayed bodiless, and the front drops the body's bytes once the answer
    is sent, as the leader's own front does when it answers these.
    """

    async def relay(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send, follower)
            return
        if scope["type"] != "http":
            return
        path = scope["path"]
        if not leader_has_route(path):
            # The leader's words: Starlette's request.url.path, escapes included.
            await _answer(send, 404, JSON, error_body(404, f"no route {URL(scope=scope).path}"))
            return
        if not is_admin_path(path):
            await _answer(send, *await _relayed(follower, scope, b""))
            return
        with router.bodies.hold() as hold:
            try:
                body = await read_body(scope, receive, hold, limit=MAX_ADMIN_BODY_BYTES,
                                       allowed=True)
            except ClientGone:
                return
            except RouterError as exc:
                retry = ([] if exc.retry_after_s is None
                         else [(b"retry-after", str(exc.retry_after_s).encode())])
                await _answer(send, exc.status, JSON + retry, error_body(exc.status,
                                                                         exc.message))
                return
            reply = await _relayed(follower, scope, body)
        # The budget is back before the answer is written: a client that reads
        # slowly holds its connection, not request bytes it no longer needs.
        await _answer(send, *reply)

    # The leader's own middleware in front: a refusal here is the leader's, byte for
    # byte, and is answered before any of the body is read.
    checked = authenticate(relay, router.config)
    return build_data_plane(router, checked)


JSON = [(b"content-type", b"application/json")]
Reply = tuple[int, list[tuple[bytes, bytes]], bytes]


async def _relayed(follower: Follower, scope: Scope, body: bytes) -> Reply:
    """The leader's answer to the request (503 if the leader is gone)."""
    try:
        reply = await follower.relay(scope, body)
    except ConnectionError:
        return 503, JSON, error_body(503, "the router is shutting down")
    headers = [(n.encode("latin-1"), v.encode("latin-1")) for n, v in reply["headers"]]
    return reply["status"], headers, base64.b64decode(reply["body"])


async def _answer(send: Send, status: int, headers: list[tuple[bytes, bytes]],
                  body: bytes) -> None:
    """The whole answer, framed here: the leader's own framing headers are dropped."""
    headers = [(n, v) for n, v in headers
               if n.lower() not in (b"content-length", b"transfer-encoding")]
    headers.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _lifespan(receive: Receive, send: Send, follower: Follower) -> None:
    """Serve once the first table is here (before it, every request would be a 503)."""
    while True:
        event = await receive()
        if event["type"] == "lifespan.startup":
            await follower.has_table.wait()
            await send({"type": "lifespan.startup.complete"})
        elif event["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
