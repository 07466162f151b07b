"""A migratable stream as it goes to its client: what the proxy carries for it
(`Stream`), how a replica's stream ends early (`Break`), and what the client gets of
each run of events (`Tracked`, the shape the stream pump in
`dpserve.router.forward.stream` applies on every leg: the first replica's and each
continuation's).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from dpserve.router.asgi import Reply, Scope
from dpserve.router.fleet.pool import Replica
from dpserve.router.migration.replay import StreamState, Trim
from dpserve.router.routing.policies import RequestInfo
from dpserve.router.upstream.connection import ResponseTooLarge

_DONE = b"data: [DONE]"
_REPLACEMENT = "\ufffd"

log = logging.getLogger("dpserve.migration")

Detokenize = Callable[[list[int]], Awaitable[str]]
"""The text of some ids, as the replica of a continuation detokenizes them."""


@dataclass(frozen=True, slots=True)
class Break:
    """A replica's stream that ended before its end: why, in the metric's words
    (`disconnected`, `stalled`, `drained`; `too_large` never moves), and what happened."""

    reason: str
    detail: str

    @property
    def movable(self) -> bool:
        """Whether a continuation elsewhere can carry the stream on: the replica failed
        (or was drained), not the stream itself. The one place that decides which
        breaks migrate."""
        return self.reason != "too_large"


@dataclass
class Stream:
    """What a migratable request carries through the proxy."""

    state: StreamState
    request_id: str
    replied: Reply
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

    def ending(self) -> bytes:
        """What a finished generation still owed the client: usage if asked, [DONE]."""
        state = self.state
        options = state.body.get("stream_options") or {}
        out = b""
        if isinstance(options, dict) and options.get("include_usage") and not state.usage_sent:
            chunk = state.identity | {
                "object": "chat.completion.chunk" if state.chat else "text_completion",
                "choices": [], "usage": state.usage_so_far()}
            out = self.event(chunk)
        return out + _DONE + b"\n\n"

    def event(self, chunk: dict[str, Any]) -> bytes:
        """One chunk the router writes itself, as an SSE event."""
        data = json.dumps(chunk, separators=(",", ":")).encode()
        return b"data: " + self.finish(data, None) + b"\n\n"


class Tracked:
    """A migratable stream's events on one leg, as its client gets them.

    The first replica's events pass on as bytes, read later
    (`StreamState.client_block`); a continuation's are parsed and rewritten into the
    client's kind (`StreamState.client_chunk`).
    """

    __slots__ = ("_continuation", "_detokenize", "_held", "_stream", "_version")

    def __init__(self, stream: Stream, version: str | None, *, continuation: bool,
                 detokenize: Detokenize | None = None) -> None:
        self._stream = stream
        self._version = version
        self._continuation = continuation
        self._detokenize = detokenize
        self._held: dict[str, Any] | None = None
        """The chunk that ended the stream at a stop string found among several
        tokens: written once it is known how many of them count (`end`)."""

    @property
    def cut(self) -> bool:
        """The router ended the stream itself (its stop string): no more is read."""
        return self._stream.state.cut

    def events(self, events: bytes) -> bytes:
        stream = self._stream
        if self._continuation:
            return self._parse_each(events)
        return stream.finish(stream.state.client_block(events), self._version)

    async def end(self, rest: bytes) -> tuple[bytes, bool]:
        """The last bytes for the client once the replica's stream ended cleanly (or
        the router ended it), and whether the client's stream is complete (else the
        replica ended it too soon)."""
        state = self._stream.state
        out = self.events(rest) if rest and not state.cut else b""
        if self._held is not None:
            out += await self._settle(self._held)
        return out, state.closed

    async def _settle(self, chunk: dict[str, Any]) -> bytes:
        """The stream's last chunk and ending, counting only the tokens of its chunk up
        to the one that completed the stop string (as far as they can be known)."""
        stream, state = self._stream, self._stream.state
        trim = state.trim
        self._held = state.trim = None
        if trim is not None:
            kept = await self._tokens_needed(trim)
            if kept < len(trim.ids):
                state.keep_of_chunk(trim, kept)
                for choice in chunk.get("choices") or ():
                    if isinstance(choice.get("token_ids"), list):
                        choice["token_ids"] = choice["token_ids"][:len(choice["token_ids"])
                                                                   - len(trim.ids) + kept]
        data = json.dumps(chunk, separators=(",", ":")).encode()
        state.closed = True
        return b"data: " + stream.finish(data, self._version) + b"\n\n" + stream.ending()

    async def _tokens_needed(self, trim: Trim) -> int:
        """How many of `trim`'s ids the stop string needed: the fewest whose text,
        detokenized after the ids before them, holds the chunk's text up to the
        string's end. All of them where that cannot be known."""
        if self._detokenize is None:
            return len(trim.ids)
        state = self._stream.state
        context = [*(state.prompt_ids or ()), *state.ids[:trim.before]]
        want = trim.text[:trim.needed]
        try:
            base = await self._detokenize(context)
            for kept in range(1, len(trim.ids)):
                text = await self._detokenize([*context, *trim.ids[:kept]])
                added = text[len(base):] if text.startswith(base) else None
                if added is None:
                    break
                if len(added) >= len(want) and not added.endswith(_REPLACEMENT):
                    return kept if added.startswith(want) else len(trim.ids)
        except (OSError, TimeoutError, ValueError, KeyError, TypeError,
                ResponseTooLarge) as exc:
            log.warning("request %s: cannot count the tokens up to its stop string (%s); "
                        "usage counts the whole last chunk", self._stream.request_id, exc)
        return len(trim.ids)

    def _parse_each(self, events: bytes) -> bytes:
        stream = self._stream
        state = stream.state
        out = []
        for event in events.split(b"\n\n"):
            event = event.strip(b"\r\n")
            if not event:
                continue
            if event == _DONE:
                state.closed = True
            if event == _DONE or not event.startswith(b"data: {"):
                out.append(event + b"\n\n")
                continue
            chunk = json.loads(event[6:])
            if "error" in chunk:  # the engine's own error: the request's, not the replica's
                state.done = True
                out.append(event + b"\n\n")
                continue
            mine = state.client_chunk(chunk, continuation=True)
            if state.cut and state.trim is not None and mine is not None:
                self._held = mine  # its token count first (`end`)
                break
            data = event[6:] if mine is None else json.dumps(mine, separators=(",", ":")).encode()
            out.append(b"data: " + stream.finish(data, self._version) + b"\n\n")
            if state.cut:  # the router's stop: the engine's rest is not wanted
                out.append(stream.ending())
                state.closed = True
                break
        return b"".join(out)
