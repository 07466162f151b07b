"""The peer channel's wire format: one router's report, signed, as one ZeroMQ message.

A message is three frames, `[PROTOCOL, payload, mac]`:

- `PROTOCOL` is also the SUB socket's topic, so a message of another protocol (or a
  later version of this one) is filtered by ZeroMQ before it costs anything here.
- `payload` is msgpack of `[sender, seq, in_flight, work, pending, fingerprint]` (an
  array, not a
  map: field names would double a typical report's size).
- `mac` is HMAC-SHA256 of `PROTOCOL + payload` under the routers' shared key.

Everything here arrives over the network, so it is hostile until checked, cheapest
check first: frame count and protocol, then the payload's size (before the MAC, so a
stranger cannot make the router hash more than `MAX_PAYLOAD_BYTES`), then the MAC (with
`hmac.compare_digest`, before a byte of the payload is parsed), and only then the
payload, against a typed schema whose bounds msgspec checks as it reads: a list's
length is checked before the list is built. So even a holder of the key (or a peer with
a bug) can send nothing that raises anything but `BadReport`, or that builds more than
the bounds below allow.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Final

import msgspec

PROTOCOL: Final = b"dpserve-peer/1"
MIN_KEY_BYTES: Final = 16
"""A shorter shared key is a configuration error: 128 bits is HMAC's floor for a
guessed key to be hopeless."""
MAC_BYTES: Final = 32
SENDER_BYTES: Final = 16
MAX_PAYLOAD_BYTES: Final = 1 << 20
"""A report is a few KiB (a few dozen replicas, the prompts of a few ms); 1 MiB is
over the largest the bounds below allow in practice and caps the HMAC's work at
about 1 ms per message."""
MAX_REPLICAS: Final = 1024
"""Entries in `in_flight` and in `work`: a fleet is tens of replicas."""
MAX_URL_CHARS: Final = 2048
"""A replica URL: the common limit of browsers and proxies."""
MAX_COUNT: Final = 1_000_000
"""Requests in flight from one router on one replica: vLLM runs hundreds at once."""
MAX_WORK: Final = 1e9
"""A decayed count of recent work: far above any real one, and finite, so that sums
of peers' work stay finite."""
MAX_PENDING: Final = 256
"""Prompts in one report: a report goes out every few ms; at 256 per report that is
tens of thousands of prompts per second. The sender keeps to it (drops the oldest)."""
MAX_KEYS: Final = 4096
"""Chain keys of one prompt: 64k tokens in 16-token blocks."""
MAX_BLOCK_SIZE: Final = 1 << 16
"""Tokens per block, as in `dpserve.router.kv.events`."""


@dataclass(frozen=True, slots=True)
class PeerReport:
    """What one router tells the others, all of it about itself."""

    sender: bytes
    """16 random bytes (`os.urandom(16)`), fixed for the router process's life: a
    restarted router is a new sender, so its `seq` may start again at 0."""
    seq: int
    """Counts from 0 per sender, +1 per report (0 <= seq < 2**63): a gap is a loss."""
    in_flight: dict[str, int]
    """Replica URL -> requests this router has in flight there now (absolute, so a lost
    report costs nothing once the next arrives)."""
    work: dict[str, float]
    """Replica URL -> this router's decayed count of recent work sent there, at the
    time of sending."""
    pending: tuple[tuple[str, int, tuple[int, ...]], ...]
    """Prompts sent since the last report: (replica URL, block size in tokens, chain
    keys of the prompt's leading full blocks, each a signed 64-bit int)."""
    fingerprint: int = 0
    """The sender's `dpserve.router.kv.index.KEY_FINGERPRINT`: its chain keys mean what
    the receiver's do only if the two are equal (same Python, same dpserve)."""


class BadReport(Exception):
    """A message that is not a valid, authentic report. `reason` is one of `"size"`,
    `"mac"` or `"format"`: a bounded label to count by (the message says more, and
    never quotes the payload)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


_Url = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_URL_CHARS)]
_Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNT)]
_Work = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_WORK)]  # NaN fails both bounds
_Key = Annotated[int, msgspec.Meta(ge=-(1 << 63), le=(1 << 63) - 1)]
_BlockSize = Annotated[int, msgspec.Meta(ge=1, le=MAX_BLOCK_SIZE)]
_Keys = Annotated[tuple[_Key, ...], msgspec.Meta(max_length=MAX_KEYS)]


class _Wire(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """The payload's shape: every field typed and bounded, none optional."""

    sender: Annotated[bytes, msgspec.Meta(min_length=SENDER_BYTES, max_length=SENDER_BYTES)]
    seq: Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
    in_flight: Annotated[dict[_Url, _Count], msgspec.Meta(max_length=MAX_REPLICAS)]
    work: Annotated[dict[_Url, _Work], msgspec.Meta(max_length=MAX_REPLICAS)]
    pending: Annotated[tuple[tuple[_Url, _BlockSize, _Keys], ...],
                       msgspec.Meta(max_length=MAX_PENDING)]
    fingerprint: _Key


_decoder: Final = msgspec.msgpack.Decoder(_Wire)
_encoder: Final = msgspec.msgpack.Encoder()


def encode(report: PeerReport, key: bytes) -> list[bytes]:
    """The frames of `report`, signed with `key`.

    Raises ValueError for a report its peers would refuse (a bound broken): a bug in
    the sender shows where it is, not as rejections counted elsewhere. The check is a
    decode of the payload, a few µs for a typical report."""
    _check_key(key)
    try:
        payload = _encoder.encode(_Wire(sender=report.sender, seq=report.seq,
                                        in_flight=report.in_flight, work=report.work,
                                        pending=report.pending,
                                        fingerprint=report.fingerprint))
    except OverflowError as e:  # an int beyond msgpack's 64 bits
        raise ValueError(f"peer report out of bounds: {e}") from None
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise ValueError(f"peer report of {len(payload)} bytes over {MAX_PAYLOAD_BYTES}")
    try:
        _decoder.decode(payload)
    except msgspec.DecodeError as e:
        raise ValueError(f"peer report out of bounds: {e}") from None
    return [PROTOCOL, payload, _mac(key, payload)]


def decode(frames: Sequence[bytes], key: bytes) -> PeerReport:
    """The report in one multipart message, checked.

    Raises `BadReport` for anything but a well-formed report within the bounds, signed
    with `key`; ValueError only for a `key` that is too short (a configuration error)."""
    _check_key(key)
    if len(frames) != 3:
        raise BadReport("format", f"expected 3 frames, got {len(frames)}")
    protocol, payload, mac = frames
    if protocol != PROTOCOL:
        raise BadReport("format", "not a dpserve-peer/1 message")
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise BadReport("size", f"payload of {len(payload)} bytes over {MAX_PAYLOAD_BYTES}")
    if not hmac.compare_digest(mac, _mac(key, payload)):
        raise BadReport("mac", "MAC does not match (another key, or altered in transit)")
    try:
        wire = _decoder.decode(payload)
    except msgspec.DecodeError as e:  # ValidationError included
        raise BadReport("format", f"payload: {e}"[:200]) from None
    return PeerReport(sender=wire.sender, seq=wire.seq, in_flight=wire.in_flight,
                      work=wire.work, pending=wire.pending, fingerprint=wire.fingerprint)


def _mac(key: bytes, payload: bytes) -> bytes:
    mac = hmac.new(key, PROTOCOL, hashlib.sha256)
    mac.update(payload)  # no copy of PROTOCOL + payload
    return mac.digest()


def _check_key(key: bytes) -> None:
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(f"peer key of {len(key)} bytes; at least {MIN_KEY_BYTES} needed")
