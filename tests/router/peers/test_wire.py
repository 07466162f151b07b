"""The peer wire format: a report comes back as it was sent, and anything else (altered,
signed with another key, out of bounds, of another shape) is `BadReport` and nothing
else, whoever signed it."""

from __future__ import annotations

import hashlib
import hmac
import math
import os
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dpserve.router.peers.wire import (
    MAX_BLOCK_SIZE,
    MAX_COUNT,
    MAX_KEYS,
    MAX_PAYLOAD_BYTES,
    MAX_PENDING,
    MAX_REPLICAS,
    MAX_URL_CHARS,
    MAX_WORK,
    PROTOCOL,
    BadReport,
    PeerReport,
    decode,
    encode,
)

KEY = b"k" * 32
SENDER = bytes(range(16))
URL = "http://10.0.0.1:8000"
SETTINGS = settings(max_examples=200, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


def report(**fields: Any) -> PeerReport:
    values: dict[str, Any] = {
        "sender": SENDER, "seq": 7, "in_flight": {URL: 3, "http://10.0.0.2:8000": 0},
        "work": {URL: 2.5}, "pending": ((URL, 16, (1, -2, 2**63 - 1, -(2**63))),)}
    values.update(fields)
    return PeerReport(**values)


def signed(payload: bytes, key: bytes = KEY) -> list[bytes]:
    """A message carrying `payload` under a valid MAC: what a key holder can send."""
    return [PROTOCOL, payload, hmac.new(key, PROTOCOL + payload, hashlib.sha256).digest()]


def wire(r: PeerReport) -> list[Any]:
    """`r`'s payload fields, unchecked, to build out-of-bounds payloads from."""
    return [r.sender, r.seq, r.in_flight, r.work, [list(p) for p in r.pending], r.fingerprint]


def test_a_report_comes_back_as_sent() -> None:
    sent = report()
    assert decode(encode(sent, KEY), KEY) == sent


urls = st.text(min_size=1, max_size=40)
reports = st.builds(
    PeerReport,
    sender=st.binary(min_size=16, max_size=16),
    seq=st.integers(0, 2**63 - 1),
    in_flight=st.dictionaries(urls, st.integers(0, MAX_COUNT), max_size=8),
    work=st.dictionaries(urls, st.floats(0, MAX_WORK), max_size=8),
    pending=st.lists(st.tuples(urls, st.integers(1, MAX_BLOCK_SIZE),
                               st.lists(st.integers(-(2**63), 2**63 - 1), max_size=20)
                               .map(tuple)), max_size=5).map(tuple))


@SETTINGS
@given(reports)
def test_any_valid_report_round_trips(sent: PeerReport) -> None:
    assert decode(encode(sent, KEY), KEY) == sent


@SETTINGS
@given(st.lists(st.binary(max_size=64), max_size=5))
def test_arbitrary_frames_are_only_ever_bad_reports(frames: list[bytes]) -> None:
    with pytest.raises(BadReport):
        decode(frames, KEY)


@SETTINGS
@given(st.binary(max_size=512))
def test_arbitrary_payloads_under_a_valid_mac_are_only_ever_bad_reports(payload: bytes) -> None:
    try:
        decoded = decode(signed(payload), KEY)
    except BadReport:
        return
    assert decode(encode(decoded, KEY), KEY) == decoded  # then it was a valid report


@SETTINGS
@given(st.data())
def test_a_flipped_bit_in_payload_or_mac_is_refused(data: st.DataObject) -> None:
    frames = encode(report(), KEY)
    which = data.draw(st.sampled_from([1, 2]))
    altered = bytearray(frames[which])
    altered[data.draw(st.integers(0, len(altered) - 1))] ^= 1 << data.draw(st.integers(0, 7))
    frames[which] = bytes(altered)
    with pytest.raises(BadReport) as raised:
        decode(frames, KEY)
    assert raised.value.reason == "mac"


def test_another_key_is_refused_as_mac() -> None:
    with pytest.raises(BadReport) as raised:
        decode(encode(report(), KEY), b"x" * 32)
    assert raised.value.reason == "mac"


@pytest.mark.parametrize("frames", [
    [], [PROTOCOL], [PROTOCOL, b""], [PROTOCOL, b"", b"", b""],
    [b"dpserve-peer/2", b"", b""],
])
def test_a_wrong_frame_count_or_protocol_is_refused_as_format(frames: list[bytes]) -> None:
    with pytest.raises(BadReport) as raised:
        decode(frames, KEY)
    assert raised.value.reason == "format"


def test_a_missing_mac_is_refused() -> None:
    frames = encode(report(), KEY)
    with pytest.raises(BadReport) as raised:
        decode([frames[0], frames[1], b""], KEY)
    assert raised.value.reason == "mac"


def test_a_payload_over_one_mib_is_refused_before_its_mac_is_computed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def no_hashing(*args: object, **kwargs: object) -> None:
        raise AssertionError("hashed an oversized payload")

    monkeypatch.setattr(hmac, "new", no_hashing)
    with pytest.raises(BadReport) as raised:
        decode([PROTOCOL, b"\0" * (MAX_PAYLOAD_BYTES + 1), b"\0" * 32], KEY)
    assert raised.value.reason == "size"


def test_an_oversized_payload_under_a_valid_mac_is_refused_too() -> None:
    with pytest.raises(BadReport) as raised:
        decode(signed(b"\0" * (MAX_PAYLOAD_BYTES + 1)), KEY)
    assert raised.value.reason == "size"


many = {f"http://r{i}": 1 for i in range(MAX_REPLICAS + 1)}
LONG_URL = "http://" + "a" * MAX_URL_CHARS
OUT_OF_BOUNDS = {
    "too many replicas in flight": report(in_flight=many),
    "too many replicas of work": report(work=dict.fromkeys(many, 1.0)),
    "a URL too long": report(in_flight={LONG_URL: 1}),
    "an empty URL": report(work={"": 1.0}),
    "a negative count": report(in_flight={URL: -1}),
    "a count too big": report(in_flight={URL: MAX_COUNT + 1}),
    "NaN work": report(work={URL: math.nan}),
    "infinite work": report(work={URL: math.inf}),
    "negative work": report(work={URL: -0.5}),
    "work too big": report(work={URL: MAX_WORK * 2}),
    "too many pending prompts": report(pending=((URL, 16, (1,)),) * (MAX_PENDING + 1)),
    "too many keys": report(pending=((URL, 16, tuple(range(MAX_KEYS + 1))),)),
    "a key over int64": report(pending=((URL, 16, (2**63,)),)),
    "block size 0": report(pending=((URL, 0, (1,)),)),
    "block size too big": report(pending=((URL, MAX_BLOCK_SIZE + 1, (1,)),)),
    "a negative seq": report(seq=-1),
    "a seq of 2**63": report(seq=2**63),
    "a short sender": report(sender=b"x" * 15),
}


@pytest.mark.parametrize("bad", OUT_OF_BOUNDS.values(), ids=OUT_OF_BOUNDS.keys())
def test_a_broken_bound_is_refused_as_format_even_under_a_valid_mac(bad: PeerReport) -> None:
    with pytest.raises(BadReport) as raised:
        decode(signed(msgspec.msgpack.encode(wire(bad))), KEY)
    assert raised.value.reason == "format"


@pytest.mark.parametrize("bad", OUT_OF_BOUNDS.values(), ids=OUT_OF_BOUNDS.keys())
def test_a_report_its_peers_would_refuse_is_not_encoded(bad: PeerReport) -> None:
    with pytest.raises(ValueError, match="out of bounds"):
        encode(bad, KEY)


def test_a_key_beyond_msgpacks_64_bits_is_not_encoded() -> None:
    with pytest.raises(ValueError, match="out of bounds"):
        encode(report(pending=((URL, 16, (-(2**63) - 1,)),)), KEY)


def nested(depth: int) -> bytes:
    return b"\x91" * depth + b"\xc0"  # [[[...[nil]...]]]


WRONG_SHAPES = {
    "deeply nested": nested(100_000),
    "nested in a field": (b"\x95" + msgspec.msgpack.encode(SENDER) + msgspec.msgpack.encode(7)
                          + nested(10_000)),
    "a map, not an array": msgspec.msgpack.encode({"sender": SENDER}),
    "a field missing": msgspec.msgpack.encode(wire(report())[:4]),
    "a field too many": msgspec.msgpack.encode([*wire(report()), 1]),
    "a string count": msgspec.msgpack.encode(wire(report(in_flight={URL: "3"}))),
    "a float count": msgspec.msgpack.encode(wire(report(in_flight={URL: 3.0}))),
    "a bool count": msgspec.msgpack.encode(wire(report(in_flight={URL: True}))),
    "a bytes URL": msgspec.msgpack.encode(wire(report(in_flight={b"u": 1}))),
    "an int URL": msgspec.msgpack.encode(wire(report(work={1: 1.0}))),
    "a pending entry short": msgspec.msgpack.encode(wire(report(pending=((URL, 16),)))),
    "truncated": msgspec.msgpack.encode(wire(report()))[:-1],
    "trailing bytes": msgspec.msgpack.encode(wire(report())) + b"\xc0",
    "an array claiming 2**32-1 items": b"\xdd\xff\xff\xff\xff",
    "empty": b"",
}


@pytest.mark.parametrize("payload", WRONG_SHAPES.values(), ids=WRONG_SHAPES.keys())
def test_a_payload_of_the_wrong_shape_is_refused_as_format_under_a_valid_mac(
        payload: bytes) -> None:
    with pytest.raises(BadReport) as raised:
        decode(signed(payload), KEY)
    assert raised.value.reason == "format"


@pytest.mark.parametrize("short", [b"", b"k" * 15])
def test_a_key_under_16_bytes_is_a_configuration_error(short: bytes) -> None:
    with pytest.raises(ValueError, match="at least 16"):
        encode(report(), short)
    with pytest.raises(ValueError, match="at least 16"):
        decode(encode(report(), KEY), short)


def test_bad_report_messages_never_quote_the_payload() -> None:
    secret = "http://secret-" + os.urandom(8).hex()
    with pytest.raises(BadReport) as raised:
        decode(signed(msgspec.msgpack.encode(wire(report(in_flight={secret: -1})))), KEY)
    assert "secret" not in str(raised.value)
