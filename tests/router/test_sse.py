"""EventFramer: a relayed stream is cut only between whole events (hypothesis over
random events and random splits)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpserve.router.sse import EventFramer, EventTooLarge, whole_events_end

# An event's lines hold no blank line; it ends with one, LF or CRLF.
LINE = st.text(st.characters(blacklist_characters="\r\n", codec="utf-8"), max_size=40)
EVENT = st.builds(lambda lines, crlf: ("\r\n" if crlf else "\n").join(
    ["data: " + line for line in lines]).encode() + (b"\r\n\r\n" if crlf else b"\n\n"),
    st.lists(LINE, min_size=1, max_size=3), st.booleans())


def pieces(data: bytes, cuts: list[int]) -> list[bytes]:
    bounds = [0, *sorted({c % (len(data) + 1) for c in cuts}), len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds) if b > a]


@settings(max_examples=300, deadline=None)
@given(st.lists(EVENT, min_size=1, max_size=8), st.lists(st.integers(0, 10_000), max_size=12),
       st.integers(0, 10_000))
def test_only_whole_events_are_passed_on_however_the_stream_is_split(events, cuts, stop):
    stream = b"".join(events)
    boundaries = {0}
    for e in events:
        boundaries.add(max(boundaries) + len(e))
    framer = EventFramer(max_event_bytes=1 << 20)
    sent = b""
    chunks = pieces(stream, cuts)
    for chunk in chunks[:stop % (len(chunks) + 1)]:  # the replica may die after any piece
        sent += framer.feed(chunk)
        assert len(sent) in boundaries  # never half an event
    if stop % (len(chunks) + 1) == len(chunks):
        assert sent + framer.rest() == stream  # a clean end passes everything on


def test_a_clean_end_passes_on_a_last_event_without_its_blank_line():
    framer = EventFramer(max_event_bytes=1024)
    assert framer.feed(b"data: 1\n\ndata: [DO") == b"data: 1\n\n"
    assert framer.holding == len(b"data: [DO")
    assert framer.feed(b"NE]") == b""
    assert framer.rest() == b"data: [DONE]"


def test_an_event_larger_than_the_limit_is_refused_after_the_whole_ones_before_it():
    framer = EventFramer(max_event_bytes=16)
    assert framer.feed(b"data: 1\n\ndata: 0123456") == b"data: 1\n\n"
    framer.check()
    assert framer.feed(b"789abcdef\n\ndata: 0123456789abcdef") == (
        b"data: 0123456789abcdef\n\n")  # the whole event goes on before the refusal
    with pytest.raises(EventTooLarge):
        framer.check()


@pytest.mark.parametrize(("data", "end"), [
    (b"", 0), (b"data: x", 0), (b"data: x\n", 0), (b"data: x\n\n", 9),
    (b"data: x\r\n\r\ndata: y", 11), (b"a\n\nb\r\n\r\nc", 8), (b"a\r\n\r\nb\n\nc", 8),
])
def test_the_end_of_the_last_whole_event(data, end):
    assert whole_events_end(data) == end
