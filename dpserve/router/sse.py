"""Relaying a replica's server-sent events whole.

A replica's stream arrives in pieces that need not end where its events do. If the
replica dies mid-event and the router simply appended its own error event, the
client would get half an event glued to the error: one `data:` line that is not
JSON, which the OpenAI clients raise on. `EventFramer` passes on only whole events
(each ends with a blank line) and holds the start of an unfinished one until the
rest arrives, so a stream the router has to end is always a run of whole events,
then the router's error event, then `data: [DONE]`.

What it holds is bounded: once the whole events before it are sent on, an
unfinished event larger than `max_event_bytes` is refused (`check` raises
`EventTooLarge`), and the stream is ended as a broken one.
"""

from __future__ import annotations

# A blank line ends an event; vLLM writes "\n\n", other servers may write CRLF.
_ENDINGS = (b"\n\n", b"\r\n\r\n")


class EventTooLarge(Exception):
    """An event grew past `max_event_bytes` without its end."""


def whole_events_end(data: bytes) -> int:
    """Index just past the last complete event in `data`; 0 if none is complete."""
    return max((i + len(end) for end in _ENDINGS if (i := data.rfind(end)) >= 0), default=0)


class EventFramer:
    """Feed it a stream's chunks in order; it returns what may be sent on (whole
    events only, possibly empty) and keeps the rest."""

    def __init__(self, max_event_bytes: int) -> None:
        self._max = max_event_bytes
        self._held = b""

    def feed(self, chunk: bytes) -> bytes:
        data = self._held + chunk if self._held else chunk
        if data.endswith(_ENDINGS):  # the usual case: the chunk ends with an event
            self._held = b""
            return data
        end = whole_events_end(data)
        self._held = data[end:]
        return data[:end]

    def check(self) -> None:
        """EventTooLarge if the unfinished event held is over the limit."""
        if len(self._held) > self._max:
            raise EventTooLarge(f"an event over {self._max} bytes")

    def rest(self) -> bytes:
        """What is held when the stream ends cleanly: a last event without its blank
        line, passed on as the replica sent it."""
        held, self._held = self._held, b""
        return held

    @property
    def holding(self) -> int:
        """Bytes of an unfinished event held back."""
        return len(self._held)
