"""A stream's life, from its replica's first byte to `[DONE]`: one owner, one pump.

`ProxyEndpoint` hands a stream to `StreamOwner.serve` once the replica answered its
head. The first chunk must come within `first_byte_timeout_s` (else 504, or a retry
while the client has seen nothing), the client's response starts with it, and every
later chunk within `stream_idle_timeout_s`. Until that first chunk the client has
nothing, so a drain may take the stream off its replica (`LiveStreams.evict`) and it
starts over on another (`StartOver`), instead of waiting for its whole generation or
being frozen by the replica's pause.

Then one pump (`_pump`) relays the replica's events, whole ones only, shaped for the
client (`Plain`, or a migratable stream's `Tracked`), until that replica's stream
ends or breaks; why it broke is decided in one place (`_broken`). A migratable stream
releases the broken replica's slot at once (its breaker hears before another replica
is chosen), the `Migrator` starts a continuation elsewhere, and the same pump relays
it into the same client stream. Any other break ends the client's stream with whole
events, an SSE error event and `[DONE]` (`dpserve.router.sse`), never a hang or half
an event.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from dpserve.config import RouterConfig
from dpserve.router.asgi import Reply
from dpserve.router.errors import RouterError, sse_error_event
from dpserve.router.fleet.adapters import versioned
from dpserve.router.fleet.breaker import Outcome, classify
from dpserve.router.fleet.live import Evicted
from dpserve.router.forward.attempt import Answered, Attempt, StartOver, TryAnother
from dpserve.router.forward.exchange import Exchange
from dpserve.router.migration.migrator import Leg, Migrator
from dpserve.router.migration.tracked import Break, Stream, Tracked
from dpserve.router.routing.dispatch import Dispatcher, Slot
from dpserve.router.sse import EventFramer, EventTooLarge
from dpserve.router.telemetry.metrics import RouterMetrics
from dpserve.router.upstream.client import UpstreamResponse

log = logging.getLogger("dpserve.proxy")


class Stalled(Exception):
    """A replica sent nothing to any stream while one waited for its first chunk."""


class Shape(Protocol):
    """What the client gets of a replica's events."""

    @property
    def cut(self) -> bool:
        """The router ended the stream itself: no more is read."""
        ...

    def events(self, events: bytes) -> bytes:
        """A run of whole events as the client gets them."""
        ...

    async def end(self, rest: bytes) -> tuple[bytes, bool]:
        """The last bytes once the replica's stream ended cleanly (or the router ended
        it), and whether the client's stream is complete."""
        ...


class Plain:
    """A stream the router does not track: renamed for the client (the adapter's
    name, the weights' fingerprint), nothing else."""

    __slots__ = ("_ex", "_version")
    cut = False

    def __init__(self, ex: Exchange, version: str | None) -> None:
        self._ex = ex
        self._version = version

    def events(self, events: bytes) -> bytes:
        return versioned(events, self._ex.adapter, self._ex.client_model, self._version)

    async def end(self, rest: bytes) -> tuple[bytes, bool]:
        return self.events(rest), True


class StreamOwner:
    """One route's streams (its metrics and timeouts bound once)."""

    def __init__(self, route: str, *, config: RouterConfig, metrics: RouterMetrics,
                 first_byte: Any, migrator: Migrator, dispatcher: Dispatcher) -> None:
        self.route = route
        self._dispatch = dispatcher
        self._live = dispatcher.streams
        self._config = config
        self._metrics = metrics
        self._first_byte = first_byte
        """The route's time-to-first-byte histogram child."""
        self._migrator = migrator

    async def serve(self, ex: Exchange, resp: UpstreamResponse, slot: Slot,
                    headers: list[tuple[bytes, bytes]], version: str | None,
                    tried: list[str]) -> Attempt:
        """Relay the stream `resp` to the client to its end, on other replicas too if it
        migrates; headers go out with the first chunk. `tried`: the replicas this
        request failed on (a drained one is not among them), then `slot`'s."""
        replica = slot.replica
        try:
            # Moved only where it can start over: a drain leaves it here otherwise.
            with self._live.running(replica.id, resp, lambda: self._dispatch.could_take(
                    ex.info, tried), restarts=True):
                first = await self._first_chunk(resp, replica.id)
        except Evicted as exc:
            slot.outcome = Outcome.ABORTED  # the router's doing: no mark on the replica
            return StartOver(f"{exc} before the stream's first chunk")
        except Stalled as exc:  # the client has nothing yet: another replica may serve
            slot.outcome = Outcome.TIMEOUT
            return TryAnother(str(exc))
        except OSError as exc:  # the client's upstream errors are OSErrors
            slot.outcome = Outcome.DISCONNECTED
            return TryAnother(f"stream dropped before its first chunk ({type(exc).__name__})")
        except TimeoutError:
            slot.outcome = Outcome.TIMEOUT
            raise RouterError(504, f"replica {replica.id} sent no token within "
                                   f"{self._config.first_byte_timeout_s:g} s") from None
        ex.first_byte_s = slot.first_byte_s = time.perf_counter() - ex.start
        self._first_byte.observe(slot.first_byte_s)
        replied = ex.assembled or ex.replied
        await replied.start(resp.status, headers)
        stream = ex.migration
        if stream is None:
            broken = await self._pump(replied, resp, slot, first, Plain(ex, version))
            if broken is not None:
                await self._cut(ex, replica.id, broken)
            return Answered(resp.status, replica.id)
        stream.version = stream.version_of(replica)
        # The first leg's slot and response are the attempt's (held by no stack of its
        # own): released early here all the same.
        return Answered(resp.status, await self._legs(ex, stream, Leg(slot, resp, first),
                                                      tried))

    async def _first_chunk(self, resp: UpstreamResponse, replica_id: str) -> bytes:
        """The stream's first chunk: within `first_byte_timeout_s` (TimeoutError; long
        prompts queue), unless the replica sent no stream a chunk for
        `stream_idle_timeout_s` meanwhile (`Stalled`): a stopped engine, not a busy one."""
        idle = self._config.stream_idle_timeout_s
        now = time.monotonic()
        began, deadline = now, now + self._config.first_byte_timeout_s
        read = asyncio.ensure_future(resp.readany())
        try:
            while True:
                quiet_from = max(began, self._live.last_heard(replica_id))
                wait = min(quiet_from + idle, deadline) - now
                if wait > 0:
                    done, _ = await asyncio.wait({read}, timeout=wait)
                    if done:
                        first = read.result()
                        self._live.heard(replica_id)
                        return first
                now = time.monotonic()
                if now >= deadline:
                    raise TimeoutError
                if now - max(began, self._live.last_heard(replica_id)) >= idle:
                    raise Stalled(f"replica {replica_id} sent no stream anything for "
                                  f"{idle:g} s before this one's first chunk")
        finally:
            if not read.done():
                read.cancel()

    async def _legs(self, ex: Exchange, stream: Stream, leg: Leg, tried: list[str]) -> str:
        """Relay a migratable stream leg after leg; the replica that ended it."""
        continuation = False
        while True:
            shape = Tracked(stream, stream.version_of(leg.slot.replica),
                            continuation=continuation,
                            detokenize=self._migrator.detokenizer(stream, leg.slot)
                            if continuation else None)
            try:
                broken = await self._pump(stream.replied, leg.resp, leg.slot, leg.first,
                                          shape, movable=lambda: self._migrator.movable(
                                              stream, tried))
            finally:  # at once: its breaker hears before the next replica is chosen
                leg.resp.release()
                leg.slot.release()
                if leg.held is not None:
                    await leg.held.aclose()
            if broken is None:
                return leg.slot.replica.id
            if not broken.movable:
                await self._cut(ex, leg.slot.replica.id, broken)
                return leg.slot.replica.id
            after = await self._migrator.next_leg(stream, broken, tried)
            if isinstance(after, str):
                return after
            leg, continuation = after, True

    async def _pump(self, replied: Reply, resp: UpstreamResponse, slot: Slot,
                    chunk: bytes, shape: Shape, *, movable: Callable[[], bool] | None = None,
                    ) -> Break | None:
        """Relay one replica's events, beginning with `chunk`, until its stream ends
        (None: the client's ended too) or breaks (why; `slot.outcome` says it for
        the breaker). `movable`: a migratable stream's, whether a drain may move it now."""
        events = EventFramer(self._config.max_response_bytes)
        idle = self._config.stream_idle_timeout_s
        live = (self._live.running(slot.replica.id, resp, movable)
                if movable is not None else contextlib.nullcontext())
        try:
            with live:
                while chunk and not shape.cut:
                    if (whole := events.feed(chunk)) and (out := shape.events(whole)):
                        await replied.body(out, more=True)
                    events.check()
                    async with asyncio.timeout(idle):
                        chunk = await resp.readany()
                    self._live.heard(slot.replica.id)
        except (OSError, TimeoutError, EventTooLarge) as exc:
            # What the client has is whole events; the unfinished one is dropped.
            return self._broken(slot, exc)
        out, complete = await shape.end(events.rest())
        if complete:
            await replied.body(out, more=False)
            return None
        if out:
            await replied.body(out, more=True)
        slot.outcome = Outcome.DISCONNECTED  # ended cleanly, yet without its last events
        return Break("disconnected", "the stream ended before its last token")

    def _broken(self, slot: Slot, exc: BaseException) -> Break:
        """Why a replica's stream broke, and what its breaker hears."""
        if isinstance(exc, EventTooLarge):
            slot.outcome = Outcome.SERVER_ERROR
            return Break("too_large", str(exc))
        if isinstance(exc, Evicted):
            slot.outcome = Outcome.ABORTED  # the router's doing: no mark on the replica
            return Break("drained", str(exc))
        slot.outcome = classify(None, exc)
        if isinstance(exc, TimeoutError):
            return Break("stalled", f"no data for {self._config.stream_idle_timeout_s:g} s")
        return Break("disconnected", "the replica closed the stream early")

    async def _cut(self, ex: Exchange, replica_id: str, broken: Break) -> None:
        """End a broken stream that does not move: an error event after whole events."""
        log.warning("stream from replica %s cut: %s", replica_id, broken.detail)
        self._metrics.stream_errors.labels(self.route, replica_id).inc()
        if ex.not_migratable and broken.movable:
            self._metrics.migrations.labels(broken.reason, "refused").inc()
            self._metrics.migration_refusals.labels(ex.not_migratable).inc()
        why = (f"; the request may not move to another replica ({ex.not_migratable})"
               if ex.not_migratable and broken.movable else "")
        await (ex.assembled or ex.replied).body(
            sse_error_event(502, f"stream interrupted: {broken.detail}{why}"), more=False)
