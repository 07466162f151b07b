"""vLLM's KV-cache events, decoded from one ZMQ message into checked dpserve values.

The wire format, as vLLM 0.32 writes it (`vllm/distributed/kv_events.py`,
`ZmqEventPublisher`):

- A PUB socket sends each batch as three frames: the topic (UTF-8, empty by default),
  the sequence number (8 bytes, big-endian, unsigned; counts from 0 per publisher and
  restarts at 0 when the engine restarts) and the payload.
- The payload is msgpack of `KVEventBatch`, an array-like struct: `[ts, events,
  data_parallel_rank]` (float seconds, list, int or nil; the rank is written even
  when nil, so 3 elements, though an encoder may omit the trailing default: 2).
- Each event is a *map* (the event classes are not array-like) tagged by
  `"type": <class name>`: `BlockStored`, `BlockRemoved` or `AllBlocksCleared`. Fields
  equal to their default are left out; fields without a default are always written,
  nil included. BlockStored: `block_hashes`, `parent_block_hash` (nil for a prompt's
  first block), `token_ids` (the tokens of all the blocks, in order), `block_size`,
  `lora_id` (deprecated), `medium` ("GPU", "CPU", ...), `lora_name`, and optionally
  `extra_keys` (per block: the LoRA name, `(mm_identifier, offset)` pairs, the cache
  salt, prompt-embedding digests), `group_idx`, `kv_cache_spec_kind`,
  `kv_cache_spec_sliding_window`, `locality`, `ownership`, `session_id`.
  BlockRemoved: `block_hashes`, `medium`, optionally `group_idx`, `locality`,
  `ownership`. AllBlocksCleared: nothing.
- A block hash is an int by default (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`: the
  engine's hash bytes, big-endian, masked to 64 bits, so 0 <= h < 2**64) or the
  engine's raw hash bytes (32 for sha256) when that variable is 0.

Replay: with `replay_endpoint` set, the publisher binds a ROUTER socket and keeps the
last `buffer_steps` (10,000) payloads. A client (DEALER or REQ) sends one frame, the
first sequence number it wants (8 bytes, big-endian; a REQ socket adds the empty
delimiter itself, a DEALER must send it: the ROUTER expects `[identity, b"", seq]`).
It gets back, for each buffered batch with seq >= start, `[b"", topic, seq, payload]`,
then the end marker `[b"", b"", (-1).to_bytes(8, "big", signed=True), b""]`: the
sequence frame all 0xff and an empty payload. Batches older than the buffer are simply
not sent, so a client that asks for seq N and first gets N+k has lost k batches for
good and must start over (drop the replica's state and wait for fresh events).

Everything here arrives over the network, so it is hostile until checked: sizes are
bounded before anything is built, a message that breaks the format raises `BadEvent`
(and nothing else), and events of a kind this code does not know (a newer vLLM) are
skipped and counted rather than failing the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Final

import msgspec

MAX_MESSAGE_BYTES: Final = 16 * 1024 * 1024
"""A payload larger than this is refused unread (a busy engine's batch is a few KiB)."""
MAX_EVENTS: Final = 65_536
"""Events in one batch: vLLM sends one batch per engine step."""
MAX_HASHES: Final = 65_536
"""Block hashes in one event: a 1M-token prompt in 16-token blocks."""
MAX_TOKENS: Final = 1 << 20
"""Token ids in one BlockStored."""
MAX_HASH_BYTES: Final = 64
"""A bytes hash: sha256 is 32."""
MAX_TOKEN_ID: Final = 1 << 31
MAX_BLOCK_SIZE: Final = 1 << 16
END_SEQ: Final = b"\xff" * 8
"""The sequence frame of the replay's end marker: -1 as 8 signed big-endian bytes."""

BlockHash = int | bytes
"""An engine's block hash as sent: an int in [0, 2**64) or at most 64 bytes."""

# msgpack's ints are 64-bit already (signed or unsigned): no bound needed on an int.
_Hash = int | Annotated[bytes, msgspec.Meta(max_length=MAX_HASH_BYTES)]
_Hashes = Annotated[list[_Hash], msgspec.Meta(max_length=MAX_HASHES)]
_Short = Annotated[str, msgspec.Meta(max_length=256)]


class BadEvent(ValueError):
    """A message that does not follow vLLM's KV-event format; `reason` says how."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Stored:
    """Blocks the engine now holds, in prompt order, each the child of the one before
    and the first the child of `parent` (None: the first block of a prompt)."""

    block_hashes: tuple[BlockHash, ...]
    parent: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_name: str | None
    lora_id: int | None
    medium: str | None = None
    group_idx: int | None = None
    opaque: tuple[bool, ...] = ()
    """Per block, True where the engine hashed more than the tokens and the LoRA (an
    image, a cache salt): such a block cannot be found from token ids. Empty: none."""


@dataclass(frozen=True, slots=True)
class Removed:
    """Blocks the engine evicted."""

    block_hashes: tuple[BlockHash, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class Cleared:
    """The engine dropped its whole prefix cache (a reset, a weight reload)."""


Event = Stored | Removed | Cleared


@dataclass(frozen=True, slots=True)
class Batch:
    """One decoded message."""

    seq: int
    events: tuple[Event, ...]
    ts: float
    data_parallel_rank: int | None
    skipped: int
    """Events of a kind unknown here, left out of `events`."""


# The wire's shapes. Unknown fields are ignored (a newer vLLM adds some); those we
# read are typed and bounded, so msgspec checks lengths before building lists.
class _Stored(msgspec.Struct, tag="BlockStored"):
    block_hashes: _Hashes
    parent_block_hash: _Hash | None
    token_ids: Annotated[list[Annotated[int, msgspec.Meta(ge=0, lt=MAX_TOKEN_ID)]],
                         msgspec.Meta(max_length=MAX_TOKENS)]
    block_size: Annotated[int, msgspec.Meta(ge=1, le=MAX_BLOCK_SIZE)]
    lora_id: int | None = None
    medium: _Short | None = None
    lora_name: _Short | None = None
    extra_keys: msgspec.Raw = msgspec.Raw(b"\xc0")  # msgpack's nil, read below
    group_idx: Annotated[int, msgspec.Meta(ge=0, lt=1 << 16)] | None = None


class _Removed(msgspec.Struct, tag="BlockRemoved"):
    block_hashes: _Hashes
    medium: _Short | None = None
    group_idx: Annotated[int, msgspec.Meta(ge=0, lt=1 << 16)] | None = None


class _Cleared(msgspec.Struct, tag="AllBlocksCleared"):
    pass


class _Batch(msgspec.Struct, array_like=True):
    ts: float
    events: Annotated[list[msgspec.Raw], msgspec.Meta(max_length=MAX_EVENTS)]
    data_parallel_rank: Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)] | None = None


class _Tag(msgspec.Struct):
    type: _Short


_KNOWN: Final = frozenset({"BlockStored", "BlockRemoved", "AllBlocksCleared"})
_batch = msgspec.msgpack.Decoder(_Batch)
_event = msgspec.msgpack.Decoder(_Stored | _Removed | _Cleared)
_tag = msgspec.msgpack.Decoder(_Tag)
# Per block: nil, or an array of keys. Only the LoRA name alone (a lone string equal
# to lora_name) keeps a block findable by its tokens.
_extra = msgspec.msgpack.Decoder(
    Annotated[list[Annotated[list[Any], msgspec.Meta(max_length=64)] | None],
              msgspec.Meta(max_length=MAX_HASHES)] | None)


def decode(frames: list[bytes]) -> Batch:
    """The batch in one multipart message `[topic, seq, payload]`.

    Raises `BadEvent` for anything else: wrong frame count, a sequence frame not 8
    bytes, an oversized or malformed payload, a known event with bad fields."""
    if len(frames) != 3:
        raise BadEvent(f"expected 3 frames, got {len(frames)}")
    _, seq_frame, payload = frames
    if len(seq_frame) != 8:
        raise BadEvent(f"sequence frame of {len(seq_frame)} bytes, not 8")
    if len(payload) > MAX_MESSAGE_BYTES:
        raise BadEvent(f"payload of {len(payload)} bytes over {MAX_MESSAGE_BYTES}")
    seq = int.from_bytes(seq_frame, "big")
    raw = _decode(_batch, payload, "batch")
    if raw.ts != raw.ts:  # NaN: vLLM writes time.time()
        raise BadEvent("batch: ts is NaN")
    events: list[Event] = []
    skipped = 0
    for item in raw.events:
        event = _decode_event(item)
        if event is None:
            skipped += 1
        else:
            events.append(event)
    return Batch(seq=seq, events=tuple(events), ts=raw.ts,
                 data_parallel_rank=raw.data_parallel_rank, skipped=skipped)


def _decode(decoder: msgspec.msgpack.Decoder[Any], data: bytes | msgspec.Raw,
            what: str) -> Any:
    try:
        return decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise BadEvent(f"{what}: {e}"[:200]) from None
    except RecursionError:  # msgspec's guard against deep nesting
        raise BadEvent(f"{what}: nested too deep") from None


def _decode_event(item: msgspec.Raw) -> Event | None:
    """The event in `item`, or None for a well-formed event of an unknown type."""
    try:
        wire = _event.decode(item)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as e:
        tag = _decode(_tag, item, "event").type
        if tag in _KNOWN:
            raise BadEvent(f"{tag}: {e}"[:200]) from None
        return None
    if isinstance(wire, _Stored):
        return _stored(wire)
    if isinstance(wire, _Removed):
        return Removed(block_hashes=tuple(wire.block_hashes), medium=wire.medium,
                       group_idx=wire.group_idx)
    return Cleared()


def _stored(wire: _Stored) -> Stored:
    opaque: tuple[bool, ...] = ()
    keys = _decode(_extra, wire.extra_keys, "BlockStored.extra_keys")
    if keys is not None:
        if len(keys) != len(wire.block_hashes):
            raise BadEvent("BlockStored: extra_keys and block_hashes differ in length")
        lora_only = [wire.lora_name] if wire.lora_name is not None else []
        opaque = tuple(k is not None and k != [] and k != lora_only for k in keys)
    return Stored(block_hashes=tuple(wire.block_hashes), parent=wire.parent_block_hash,
                  token_ids=tuple(wire.token_ids), block_size=wire.block_size,
                  lora_name=wire.lora_name, lora_id=wire.lora_id, medium=wire.medium,
                  group_idx=wire.group_idx, opaque=opaque)
