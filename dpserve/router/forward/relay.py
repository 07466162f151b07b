"""Relaying a replica's SSE stream to the client, event by whole event.

`ProxyEndpoint` hands a stream over once the replica answered its head: the
first chunk must come within `first_byte_timeout_s` (else 504, or a retry while
the client has seen nothing), the client's response starts with it, and every
later chunk within `stream_idle_timeout_s`. Until that first chunk the client
has nothing, so a drain may take the stream off its replica (`LiveStreams.evict`)
and it starts over on another (`Restart`), instead of waiting for its whole
generation or being frozen by the replica's pause. A stream the router tracks for
migration goes to the `Migrator`, which can carry it on elsewhere; any other is
relayed here, and if it breaks, ends with whole events, an SSE error event and
`[DONE]` (`dpserve.router.sse`), never a hang or half an event.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from dpserve.config import RouterConfig
from dpserve.router.errors import RouterError, sse_error_event
from dpserve.router.fleet.adapters import versioned
from dpserve.router.fleet.breaker import Outcome, classify
from dpserve.router.fleet.live import Evicted, LiveStreams
from dpserve.router.forward.exchange import Exchange
from dpserve.router.migration.migrator import Broken, Migrator
from dpserve.router.routing.dispatch import Slot
from dpserve.router.sse import EventFramer, EventTooLarge
from dpserve.router.telemetry.metrics import RouterMetrics
from dpserve.router.upstream.client import UpstreamResponse

log = logging.getLogger("dpserve.proxy")

# Errors that mean "the connection broke or never was": `upstream`'s ConnectFailed
# and Disconnected are OSErrors.
_UNREACHABLE = (OSError,)


class Restart(str):
    """Why a stream left its replica before its first chunk (a drain): it starts over
    on another replica, which is no failure and no retry."""


def _always() -> bool:
    return True


class StreamRelay:
    """One route's stream relay (its metrics and timeouts bound once)."""

    def __init__(self, route: str, *, config: RouterConfig, metrics: RouterMetrics,
                 first_byte: Any, migrator: Migrator, live: LiveStreams) -> None:
        self.route = route
        self._live = live
        self._config = config
        self._metrics = metrics
        self._first_byte = first_byte
        """The route's time-to-first-byte histogram child."""
        self._migrator = migrator

    async def relay(
        self, ex: Exchange, resp: UpstreamResponse, slot: Slot,
        headers: list[tuple[bytes, bytes]], version: str | None,
    ) -> int | str | Broken:
        """Forward an SSE stream chunk by chunk; headers go out with the first chunk."""
        replica = slot.replica
        idle = self._config.stream_idle_timeout_s
        reader = resp
        try:
            with self._live.running(replica.id, resp, _always, restarts=True):
                async with asyncio.timeout(self._config.first_byte_timeout_s):
                    first = await reader.readany()
        except Evicted as exc:
            slot.outcome = Outcome.ABORTED  # the router's doing: no mark on the replica
            return Restart(f"{exc} before the stream's first chunk")
        except _UNREACHABLE as exc:
            slot.outcome = Outcome.DISCONNECTED
            return f"stream dropped before its first chunk ({type(exc).__name__})"
        except TimeoutError:
            slot.outcome = Outcome.TIMEOUT
            raise RouterError(504, f"replica {replica.id} sent no token within "
                                   f"{self._config.first_byte_timeout_s:g} s") from None
        replied = ex.replied
        ex.first_byte_s = slot.first_byte_s = time.perf_counter() - ex.start
        self._first_byte.observe(slot.first_byte_s)
        await replied.start(resp.status, headers)
        if ex.migration is not None:
            return await self._migrator.relay(ex.migration, resp, slot, first)
        events = EventFramer(self._config.max_response_bytes)
        chunk = first
        try:
            while chunk:
                if whole := events.feed(chunk):
                    await replied.body(versioned(whole, ex.adapter, ex.client_model, version),
                                       more=True)
                events.check()
                async with asyncio.timeout(idle):
                    chunk = await reader.readany()
        except (*_UNREACHABLE, TimeoutError, EventTooLarge) as exc:
            # What the client has is whole events; the unfinished one is dropped.
            slot.outcome = (Outcome.SERVER_ERROR if isinstance(exc, EventTooLarge)
                            else classify(None, exc))
            reason = (f"no data for {idle:g} s" if isinstance(exc, TimeoutError)
                      else str(exc) if isinstance(exc, EventTooLarge)
                      else "the replica closed the stream early")
            log.warning("stream from replica %s cut: %s", replica.id, reason)
            self._metrics.stream_errors.labels(self.route, replica.id).inc()
            if ex.not_migratable and not isinstance(exc, EventTooLarge):
                self._metrics.migrations.labels(
                    "stalled" if isinstance(exc, TimeoutError) else "disconnected",
                    "refused").inc()
                self._metrics.migration_refusals.labels(ex.not_migratable).inc()
            await replied.body(sse_error_event(502, f"stream interrupted: {reason}"), more=False)
            return resp.status
        await replied.body(versioned(events.rest(), ex.adapter, ex.client_model, version),
                           more=False)
        return resp.status

