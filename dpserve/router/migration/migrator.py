"""Where a broken stream goes next: a continuation on another replica, or its end.

The stream pump (`dpserve.router.forward.stream`) relays a migratable stream
(`dpserve.router.migration.replay`) event by event, learning its token ids as it
goes. When the replica's connection breaks or no chunk comes for
`stream_idle_timeout_s`, it releases that replica's slot (the breaker hears of the
failure) and asks `Migrator.next_leg` for the rest: a continuation from another
replica, chosen by the policy as usual among the replicas this request has not
broken on (a drained one did not break it: it may take the stream back once it
serves), which it relays into the same client stream. If none is ready but one is
coming into rotation (starting, reloading), the continuation waits for it in the
router's queue, `queue_timeout_s` at most: the client's stream is stalled already,
and a rolling deploy's other replica is seconds away. That repeats up to
`migration_limit` times. Where a continuation cannot be made (a limit reached, no
replica left), the client gets what a broken stream always got: an error event,
then `[DONE]`, after whole events only. A stream that broke after its last token
(the finish chunk came, the rest did not) is finished by the router itself. A drain
moves only the streams that can go on somewhere (`movable`): the others stay on
their draining replica, which still serves them.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass

from dpserve.config import RouterConfig
from dpserve.router.errors import sse_error_event
from dpserve.router.fleet.breaker import classify
from dpserve.router.fleet.pool import ReplicaPool
from dpserve.router.headers import upstream_header_block
from dpserve.router.jsonbody import encode
from dpserve.router.migration.continuation import continuation
from dpserve.router.migration.replay import StreamState
from dpserve.router.migration.stops import REPLACEMENT, StopScan, held_text
from dpserve.router.migration.tracked import Break, Stream
from dpserve.router.routing.dispatch import Dispatcher, Slot, Unavailable, logged_waiting
from dpserve.router.telemetry.metrics import RouterMetrics
from dpserve.router.upstream.client import Origin, UpstreamClient, UpstreamResponse
from dpserve.router.upstream.connection import ResponseTooLarge

log = logging.getLogger("dpserve.migration")

_CONTINUATION = b"POST /v1/completions"
_DETOKENIZE = b"POST /detokenize"


@dataclass
class Leg:
    """One replica's part of a stream: its slot and its response (the first chunk
    read), held by `held` (a continuation's) until the stream pump is done with them."""

    slot: Slot
    resp: UpstreamResponse
    first: bytes
    held: AsyncExitStack | None = None


class Migrator:
    """Where a broken stream goes next: a continuation on another replica, or its end."""

    def __init__(self, *, pool: ReplicaPool, dispatcher: Dispatcher, upstream: UpstreamClient,
                 origin: Callable[[str], Origin], config: RouterConfig,
                 metrics: RouterMetrics) -> None:
        self._pool = pool
        self._dispatch = dispatcher
        self._upstream = upstream
        self._origin = origin
        self._config = config
        self._metrics = metrics

    def movable(self, stream: Stream, tried: list[str]) -> bool:
        """Whether a drain could move the stream now (`dpserve.router.fleet.live`): it
        can go on, and a replica it has not failed on (`tried`, its own last) is ready
        or coming into rotation. Else it stays where it is: its replica, draining,
        still serves it, where a move would cut it."""
        return (not stream.state.closed and self._refused(stream.state) is None
                and self._dispatch.could_take(stream.info, tried))

    async def next_leg(self, stream: Stream, broken: Break, tried: list[str]) -> Leg | str:
        """Carry `stream` on after `broken`: a continuation that started on another
        replica (its first chunk came), or, where the stream ends here, the id of the
        replica that ended it (`none` if none could; the client got its ending or
        an error event). `tried` holds the replicas it broke on (not taken again),
        last the one it broke on now; a drained one is taken out (it did not fail:
        it may take the stream again once it serves)."""
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
                await stream.replied.body(stream.ending(), more=False)
                return source
            why = self._refused(state)
            if why is not None:
                return await self._give_up(stream, reason, "refused", detail, why, source)
            state.rewind(keep=bool(state.stops))
            body = continuation(state)
            if body is None:  # every token came; only the finish chunk was lost
                await stream.replied.body(stream.event(state.finish_chunk("length")),
                                          more=True)
                continue
            try:
                slot = await self._choose(stream, [*tried, source])
            except Unavailable as exc:  # none left, none came in time, the queue full
                return await self._give_up(stream, reason, "failed", detail, exc.message,
                                           source)
            replica = slot.replica
            tried.append(replica.id)
            async with AsyncExitStack() as held:
                held.enter_context(slot)
                if state.stops:
                    if not await self._stop_seam(stream, slot):
                        return await self._give_up(stream, reason, "refused", detail,
                                                   "seam_text", source)
                    body = continuation(state) or body
                if body["max_tokens"] is None:  # no limit: what the context leaves
                    if replica.max_model_len is None:
                        return await self._give_up(stream, reason, "refused", detail,
                                                   "no_context_length", source)
                    left = replica.max_model_len - len(body["prompt"])
                    if left <= 0:  # a shorter context than its first replica's, full
                        # already: the stream ends as it would there
                        await stream.replied.body(
                            stream.event(state.finish_chunk("length")), more=True)
                        continue
                    body["max_tokens"] = left
                data = encode(body)
                if data is None:  # a field carried on nests past what can be written
                    return await self._give_up(stream, reason, "refused", detail,
                                               "nested_too_deeply", source)
                started = await self._start(stream, slot, data, held, detail)
                if isinstance(started, Leg):
                    seam = state.seam(source, replica.id, reason)
                    self._metrics.migrations.labels(reason, "migrated").inc()
                    log.log(logging.INFO if reason == "drained" else logging.WARNING,
                            "request %s: stream moved from replica %s to %s (%s: %s); "
                            "%d tokens replayed", stream.request_id, source, replica.id,
                            reason, detail, seam.replayed_tokens)
                    started.held = held.pop_all()
                    return started
                detail = started
            self._metrics.migrations.labels(reason, "failed").inc()

    async def _start(self, stream: Stream, slot: Slot, data: bytes, held: AsyncExitStack,
                     detail: str) -> Leg | str:
        """Ask `slot`'s replica for the continuation `data`: the leg once its first
        chunk came, else what happened (the break's detail, with this)."""
        replica = slot.replica
        config = self._config
        headers = upstream_header_block(stream.scope, stream.request_id, len(data),
                                        stream.trace)
        try:
            resp = await held.enter_async_context(self._upstream.open(
                self._origin(replica.url), _CONTINUATION, headers, data,
                connect_timeout_s=config.connect_timeout_s,
                head_timeout_s=config.first_byte_timeout_s))
        except (OSError, TimeoutError) as exc:
            slot.outcome = classify(None, exc)
            return f"{detail}; continuation not accepted ({type(exc).__name__})"
        slot.outcome = classify(resp.status, None)
        if resp.status != 200 or resp.content_type != "text/event-stream":
            return f"{detail}; continuation answered {resp.status}"
        try:
            async with asyncio.timeout(config.first_byte_timeout_s):
                first = await resp.readany()
        except (OSError, TimeoutError) as exc:
            slot.outcome = classify(None, exc)
            return f"{detail}; continuation dropped ({type(exc).__name__})"
        return Leg(slot, resp, first, held)

    async def _choose(self, stream: Stream, tried: list[str]) -> Slot:
        """A replica not tried yet, on the weights the stream began on if one is ready
        (mid-deploy, a continuation elsewhere would mix two versions); if none is ready
        but one is coming into rotation, it is waited for (`queue_timeout_s` at most)."""
        other = [r.id for r in self._pool.ready()
                 if r.id not in tried and stream.version_of(r) != stream.version]
        if other and len(other) < len([r for r in self._pool.ready() if r.id not in tried]):
            try:
                return await self._dispatch.choose(stream.info, [*tried, *other])
            except Unavailable:
                pass  # those are failing: any version beats a broken stream
        return await self._dispatch.choose(stream.info, tried, waiting=logged_waiting(
            log, stream.request_id, "carry the stream on", self._config.queue_timeout_s))

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

    def detokenizer(self, stream: Stream, slot: Slot) -> Callable[[list[int]], Awaitable[str]]:
        """Ids to text, as `slot`'s replica (a continuation's) detokenizes them."""
        return functools.partial(self._detokenize, stream, slot)

    async def _detokenize(self, stream: Stream, slot: Slot, ids: list[int]) -> str:
        data = json.dumps({"tokens": ids}, separators=(",", ":")).encode()
        headers = b"content-type: application/json\r\nx-request-id: %s\r\n" \
                  b"content-length: %d\r\n\r\n" % (stream.request_id.encode("latin-1"),
                                                     len(data))
        config = self._config
        async with self._upstream.open(self._origin(slot.replica.url), _DETOKENIZE, headers,
                                       data, connect_timeout_s=config.connect_timeout_s,
                                       head_timeout_s=config.first_byte_timeout_s) as resp:
            async with asyncio.timeout(config.first_byte_timeout_s):
                answer = await resp.read(config.max_response_bytes)
        if resp.status != 200:
            raise ValueError(f"/detokenize answered {resp.status}")
        text = json.loads(answer)["prompt"]
        if not isinstance(text, str):
            raise TypeError("/detokenize answered no text")
        return text

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
        await stream.replied.body(sse_error_event(
            502, f"stream interrupted: {detail}; not moved to another replica: {why}"),
            more=False)
        return "none"
