"""Keeping a stream alive when its replica dies or stalls: relay, then migrate.

`Migrator.relay` forwards a migratable stream (`dpserve.router.migration.replay`) event by
event, learning its token ids as it goes. When the replica's connection breaks or
no chunk comes for `stream_idle_timeout_s`, it returns `Broken` instead of ending
the stream; the proxy leaves that replica's slot (the breaker hears of the failure)
and calls `resume`, which asks another replica for the continuation, chosen by the
policy as usual among the replicas this request has not broken on, and relays it
into the same client stream. That repeats up to `migration_limit` times. Where a
continuation cannot be made (a limit reached, no replica left), the client gets
what a broken stream always got: an error event, then `[DONE]`, after whole events
only. A stream that broke after its last token (the finish chunk came, the rest
did not) is finished by the router itself.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dpserve.config import RouterConfig
from dpserve.router.asgi import ReplyTracker, Scope
from dpserve.router.errors import sse_error_event
from dpserve.router.fleet.breaker import Outcome, classify
from dpserve.router.fleet.live import Evicted
from dpserve.router.fleet.pool import Replica, ReplicaPool
from dpserve.router.headers import upstream_header_block
from dpserve.router.jsonbody import encode
from dpserve.router.migration.continuation import continuation
from dpserve.router.migration.replay import StreamState
from dpserve.router.migration.stops import REPLACEMENT, StopScan, held_text
from dpserve.router.routing.dispatch import Dispatcher, Slot, Unavailable
from dpserve.router.routing.policies import RequestInfo
from dpserve.router.sse import EventFramer, EventTooLarge
from dpserve.router.telemetry.metrics import RouterMetrics
from dpserve.router.upstream.client import Origin, UpstreamPool, UpstreamResponse
from dpserve.router.upstream.connection import ResponseTooLarge

log = logging.getLogger("dpserve.migration")

_DONE = b"data: [DONE]"
_CONTINUATION_LINE = b"POST /v1/completions HTTP/1.1"
_DETOKENIZE_LINE = b"POST /detokenize HTTP/1.1"


@dataclass
class Broken:
    """A stream whose replica failed after the client started getting it."""

    reason: str
    """`disconnected`, `stalled` or `drained`: the metric's label."""
    detail: str
    status: int
    """The status the client was sent (the stream's)."""


@dataclass
class Stream:
    """What a migratable request carries through the proxy."""

    state: StreamState
    request_id: str
    replied: ReplyTracker
    info: RequestInfo
    scope: Scope
    version_of: Callable[[Replica], str | None]
    """The version that answers on a replica (adapter or base weights)."""
    finish: Callable[[bytes, str | None], bytes]
    """An outgoing chunk as the client gets it (model renamed, fingerprint set)."""
    version: str | None = None
    """The weights it began on: a continuation prefers replicas serving them."""
    trace: bytes = b""
    """The router span's trace headers (`dpserve.router.telemetry.tracing`), if tracing is on."""


class Migrator:
    def __init__(self, *, pool: ReplicaPool, dispatcher: Dispatcher, upstream: UpstreamPool,
                 origin: Callable[[str], Origin], config: RouterConfig,
                 metrics: RouterMetrics) -> None:
        self._pool = pool
        self._dispatch = dispatcher
        self._upstream = upstream
        self._origin = origin
        self._config = config
        self._metrics = metrics

    async def relay(self, stream: Stream, resp: UpstreamResponse, slot: Slot,
                    first: bytes) -> int | Broken:
        """Forward one upstream stream whose first chunk is `first` (the client's
        response has started); its status, or Broken to be resumed elsewhere."""
        stream.version = stream.version_of(slot.replica)
        broken = await self._pump(stream, resp, slot, first, continuation=False)
        return resp.status if broken is None else Broken(*broken, status=resp.status)

    async def resume(self, stream: Stream, broken: Broken, tried: list[str]) -> str:
        """Carry `stream` on after `broken`; the id of the replica that ended it
        (`none` if none could). `tried` holds the replicas it broke on (not taken
        again) and, last, the one it broke on now; a drained one may be taken again
        once it serves (it did not fail)."""
        state = stream.state
        reason, detail, source = broken.reason, broken.detail, tried[-1]
        while True:
            state.learn()
            if reason == "drained" and source in tried:
                tried.remove(source)
            if state.closed:  # `[DONE]` went out: only the response's own end was lost
                await stream.replied.body(b"", more=False)
                return source
            if state.done:  # only the ending was lost: the router writes it
                await stream.replied.body(self._ending(stream), more=False)
                return source
            why = self._refused(state)
            if why is not None:
                return await self._give_up(stream, reason, "refused", detail, why, source)
            state.rewind(keep=bool(state.stops))
            body = continuation(state)
            if body is None:  # every token came; only the finish chunk was lost
                last = self._chunk(stream, state.finish_chunk("length"))
                await stream.replied.body(last, more=True)
                continue
            try:
                slot = await self._choose(stream, [*tried, source])
            except Unavailable:
                return await self._give_up(stream, reason, "failed", detail,
                                           "no other replica is available", source)
            replica = slot.replica
            tried.append(replica.id)
            with slot:
                if state.stops:
                    if not await self._stop_seam(stream, slot):
                        return await self._give_up(stream, reason, "refused", detail,
                                                   "seam_text", source)
                    body = continuation(state) or body
                if body["max_tokens"] is None:  # no limit: to the context's end
                    if replica.max_model_len is None:
                        return await self._give_up(stream, reason, "refused", detail,
                                                   "no_context_length", source)
                    body["max_tokens"] = replica.max_model_len
                data = encode(body)
                if data is None:  # a field carried on nests past what can be written
                    return await self._give_up(stream, reason, "refused", detail,
                                               "nested_too_deeply", source)
                outcome = await self._continue(stream, slot, data, source, reason, detail)
            if outcome is None:
                return replica.id
            started, why_broken, detail = outcome
            if started:  # it moved, then broke again: a new break on a new replica
                reason, source = why_broken, replica.id
            else:
                self._metrics.migrations.labels(reason, "failed").inc()

    async def _choose(self, stream: Stream, tried: list[str]) -> Slot:
        """A replica not tried yet, on the weights the stream began on if one is ready
        (mid-deploy, a continuation elsewhere would mix two versions)."""
        other = [r.id for r in self._pool.ready()
                 if r.id not in tried and stream.version_of(r) != stream.version]
        if other and len(other) < len([r for r in self._pool.ready() if r.id not in tried]):
            try:
                return await self._dispatch.choose(stream.info, [*tried, *other])
            except Unavailable:
                pass  # those are failing: any version beats a broken stream
        return await self._dispatch.choose(stream.info, tried)

    async def _stop_seam(self, stream: Stream, slot: Slot) -> bool:
        """Ready the router's stop-string check for a continuation on `slot`: the text
        of the replayed ids the client has not got yet (vLLM held it back) comes first
        (`dpserve.router.migration.stops`). False if that text cannot be known."""
        state = stream.state
        prompt = list(state.prompt_ids or ())
        try:
            before = await self._detokenize(stream, slot, prompt)
            full = await self._detokenize(stream, slot, [*prompt, *state.ids])
            held = held_text(full, before, state.sent)
            # Held text ending in U+FFFD: the last ids may be part of a character (the
            # client never saw it; vLLM prints one it cannot decode, which it did see).
            for _ in range(3):  # a UTF-8 character is at most 4 bytes, so 3 tokens' worth
                if held is None or not held.endswith(REPLACEMENT) or not state.ids:
                    break
                state.drop_last()  # generated again
                full = await self._detokenize(stream, slot, [*prompt, *state.ids])
                held = held_text(full, before, state.sent)
        except (OSError, TimeoutError, ValueError, KeyError, TypeError, ResponseTooLarge) as exc:
            log.warning("request %s: cannot detokenize on replica %s (%s)",
                        stream.request_id, slot.replica.id, exc)
            return False
        if held is None:
            return False
        state.scan = StopScan.at_seam(state.stops, state.body, state.sent, held,
                                      len(state.ids))
        return True

    async def _detokenize(self, stream: Stream, slot: Slot, ids: list[int]) -> str:
        data = json.dumps({"tokens": ids}, separators=(",", ":")).encode()
        origin = self._origin(slot.replica.url)
        head = b"%s\r\nhost: %s\r\ncontent-type: application/json\r\nx-request-id: %s\r\n" \
               b"content-length: %d\r\n\r\n" % (_DETOKENIZE_LINE, origin.host_header,
                                                stream.request_id.encode("latin-1"), len(data))
        config = self._config
        resp = await self._upstream.request(origin, head, data,
                                            connect_timeout_s=config.connect_timeout_s,
                                            head_timeout_s=config.first_byte_timeout_s)
        try:
            async with asyncio.timeout(config.first_byte_timeout_s):
                answer = await resp.read(config.max_response_bytes)
            if resp.status != 200:
                raise ValueError(f"/detokenize answered {resp.status}")
            text = json.loads(answer)["prompt"]
            if not isinstance(text, str):
                raise TypeError("/detokenize answered no text")
            return text
        finally:
            resp.release()

    async def _continue(self, stream: Stream, slot: Slot, data: bytes, source: str,
                        reason: str, detail: str) -> tuple[bool, str, str] | None:
        """One continuation (`data`, its body) on `slot`; None once the stream ended,
        else whether it had started (then: it broke again), why and what happened."""
        replica = slot.replica
        origin = self._origin(replica.url)
        head = b"%s\r\nhost: %s\r\n%s" % (_CONTINUATION_LINE, origin.host_header,
                                          upstream_header_block(stream.scope,
                                                                stream.request_id, len(data),
                                                                stream.trace))
        config = self._config
        try:
            resp = await self._upstream.request(
                origin, head, data, connect_timeout_s=config.connect_timeout_s,
                head_timeout_s=config.first_byte_timeout_s)
        except (OSError, TimeoutError) as exc:
            slot.outcome = classify(None, exc)
            return False, reason, f"{detail}; continuation not accepted ({type(exc).__name__})"
        try:
            slot.outcome = classify(resp.status, None)
            if resp.status != 200 or resp.content_type != "text/event-stream":
                return False, reason, f"{detail}; continuation answered {resp.status}"
            try:
                async with asyncio.timeout(config.first_byte_timeout_s):
                    first = await resp.readany()
            except (OSError, TimeoutError) as exc:
                slot.outcome = classify(None, exc)
                return False, reason, f"{detail}; continuation dropped ({type(exc).__name__})"
            seam = stream.state.seam(source, replica.id, reason)
            self._metrics.migrations.labels(reason, "migrated").inc()
            log.log(logging.INFO if reason == "drained" else logging.WARNING,
                    "request %s: stream moved from replica %s to %s (%s: %s); "
                    "%d tokens replayed", stream.request_id, source, replica.id,
                    reason, detail, seam.replayed_tokens)
            broken = await self._pump(stream, resp, slot, first, continuation=True)
            return None if broken is None else (True, *broken)
        finally:
            resp.release()

    async def _pump(self, stream: Stream, resp: UpstreamResponse, slot: Slot, chunk: bytes,
                    *, continuation: bool) -> tuple[str, str] | None:
        """Relay events until the upstream ends (None) or breaks (why)."""
        idle = self._config.stream_idle_timeout_s
        events = EventFramer(self._config.max_response_bytes)
        version = stream.version_of(slot.replica)
        try:
            with self._dispatch.streams.running(
                    slot.replica.id, resp, lambda: not stream.state.closed
                    and self._refused(stream.state) is None):
                while chunk and not stream.state.cut:
                    if whole := events.feed(chunk):
                        await self._send(stream, whole, version, continuation)
                    events.check()
                    async with asyncio.timeout(idle):
                        chunk = await resp.readany()
        except EventTooLarge as exc:
            slot.outcome = Outcome.SERVER_ERROR
            await stream.replied.body(sse_error_event(502, f"stream interrupted: {exc}"),
                                      more=False)
            return None
        except Evicted as exc:
            slot.outcome = Outcome.ABORTED  # the router's doing: no mark on the replica
            return "drained", str(exc)
        except (OSError, TimeoutError) as exc:
            slot.outcome = classify(None, exc)
            if isinstance(exc, TimeoutError):
                return "stalled", f"no data for {idle:g} s"
            return "disconnected", "the replica closed the stream early"
        if not stream.state.cut and (rest := events.rest()):
            await self._send(stream, rest, version, continuation)
        if not stream.state.closed:  # ended cleanly, yet without its last events
            slot.outcome = Outcome.DISCONNECTED
            return "disconnected", "the stream ended before its last token"
        await stream.replied.body(b"", more=False)
        return None

    async def _send(self, stream: Stream, events: bytes, version: str | None,
                    continuation: bool) -> None:
        """Relay a run of whole events: the engine's own passed on as bytes, read
        later (`StreamState.client_block`); a continuation's parsed and rewritten
        into the client's kind (`client_chunk`)."""
        if continuation:
            out = self._parse_each(stream, events, version, continuation)
        else:
            out = stream.finish(stream.state.client_block(events), version)
        if out:
            await stream.replied.body(out, more=True)

    def _parse_each(self, stream: Stream, events: bytes, version: str | None,
                    continuation: bool) -> bytes:
        out = []
        for event in events.split(b"\n\n"):
            event = event.strip(b"\r\n")
            if not event:
                continue
            if event == _DONE:
                stream.state.closed = True
            if event == _DONE or not event.startswith(b"data: {"):
                out.append(event + b"\n\n")
                continue
            chunk = json.loads(event[6:])
            if "error" in chunk:  # the engine's own error: the request's, not the replica's
                stream.state.done = True
                out.append(event + b"\n\n")
                continue
            mine = stream.state.client_chunk(chunk, continuation=continuation)
            data = event[6:] if mine is None else json.dumps(mine, separators=(",", ":")).encode()
            out.append(b"data: " + stream.finish(data, version) + b"\n\n")
            if stream.state.cut:  # the router's stop: the engine's rest is not wanted
                out.append(self._ending(stream))
                stream.state.closed = True
                break
        return b"".join(out)

    def _refused(self, state: StreamState) -> str | None:
        state.learn()
        if len(state.seams) >= self._config.migration_limit:
            return "limit"
        if not state.started:
            return "no_prompt_ids"
        if state.context_tokens() > self._config.migration_max_tokens:
            return "max_tokens"
        return None

    async def _give_up(self, stream: Stream, reason: str, outcome: str, detail: str,
                       why: str, source: str) -> str:
        """The client's stream ends cut, as it would without migration."""
        self._metrics.migrations.labels(reason, outcome).inc()
        self._metrics.stream_errors.labels(stream.info.route, source).inc()
        if outcome == "refused":
            self._metrics.migration_refusals.labels(why).inc()
        log.warning("request %s: stream cut (%s), not migrated: %s", stream.request_id,
                    detail, why)
        await stream.replied.body(sse_error_event(502, f"stream interrupted: {detail}"),
                                  more=False)
        return "none"

    def _ending(self, stream: Stream) -> bytes:
        """What a finished generation still owed the client: usage if asked, [DONE]."""
        state = stream.state
        options = state.body.get("stream_options") or {}
        out = b""
        if isinstance(options, dict) and options.get("include_usage") and not state.usage_sent:
            chunk = state.identity | {
                "object": "chat.completion.chunk" if state.chat else "text_completion",
                "choices": [], "usage": state.usage_so_far()}
            out = self._chunk(stream, chunk)
        return out + _DONE + b"\n\n"

    @staticmethod
    def _chunk(stream: Stream, chunk: dict[str, Any]) -> bytes:
        data = json.dumps(chunk, separators=(",", ":")).encode()
        return b"data: " + stream.finish(data, None) + b"\n\n"
