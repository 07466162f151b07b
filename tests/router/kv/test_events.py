import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dpserve.router.kv.events import (
    MAX_EVENTS,
    MAX_HASHES,
    MAX_MESSAGE_BYTES,
    BadEvent,
    Cleared,
    Removed,
    Stored,
    decode,
)

enc = msgspec.msgpack.encode
SEQ = (7).to_bytes(8, "big")


def stored_map(**kw):
    event = {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None,
             "token_ids": [5, 6, 7, 8], "block_size": 2, "lora_id": None,
             "medium": "GPU", "lora_name": None}
    return event | kw


def message(events, ts=1.0, *rest):
    return [b"", SEQ, enc([ts, events, *rest])]


def test_a_batch_decodes_to_its_events_and_sequence_number():
    batch = decode(message([stored_map(), {"type": "BlockRemoved", "block_hashes": [b"h"],
                                           "medium": None},
                            {"type": "AllBlocksCleared"}], 2.5, 1))
    assert batch.seq == 7 and batch.ts == 2.5 and batch.data_parallel_rank == 1
    assert batch.events == (
        Stored(block_hashes=(1, 2), parent=None, token_ids=(5, 6, 7, 8), block_size=2,
               lora_name=None, lora_id=None, medium="GPU"),
        Removed(block_hashes=(b"h",)), Cleared())


def test_unknown_event_types_are_skipped_and_counted():
    batch = decode(message([{"type": "BlockMoved", "x": [1]}, {"type": "AllBlocksCleared"}]))
    assert batch.events == (Cleared(),) and batch.skipped == 1


def test_extra_keys_beyond_the_adapter_mark_blocks_opaque():
    batch = decode(message([stored_map(lora_name="a", extra_keys=[["a"], ["a", "salt"]])]))
    assert batch.events[0].opaque == (False, True)


@pytest.mark.parametrize("frames, reason", [
    ([b"", SEQ], "3 frames"),
    ([b"", b"\x00" * 7, enc([1.0, []])], "not 8"),
    ([b"", SEQ, enc([1.0, []])[:-1]], "truncated"),
    ([b"", SEQ, b""], "truncated"),
    ([b"", SEQ, enc({"ts": 1.0})], "batch"),
    ([b"", SEQ, enc(["now", []])], "batch"),
    ([b"", SEQ, enc([float("nan"), []])], "NaN"),
    ([b"", SEQ, b"\x91" * 100_000 + b"\xc0"], "batch"),
    ([b"", SEQ, b"\x92\x01" + b"\x91" * 100_000 + b"\xc0"], "batch"),
    ([b"", SEQ, b"\x92\x01\x91" + b"\x81\xa1x" * 100_000 + b"\xc0"], "too deep"),
    ([b"", SEQ, b"\x92\x01\xdd\xff\xff\xff\xff"], "batch"),
    ([b"", SEQ, b"\x00" * (MAX_MESSAGE_BYTES + 1)], "payload"),
    ([b"", SEQ, enc([1.0, [None] * (MAX_EVENTS + 1)])], "batch"),
    ([b"", SEQ, enc([1.0, [5]])], "event"),
])
def test_malformed_messages_raise_bad_event(frames, reason):
    with pytest.raises(BadEvent, match=reason):
        decode(frames)


@pytest.mark.parametrize("fields", [
    {"block_hashes": list(range(MAX_HASHES + 1))},
    {"block_hashes": [1.5]},
    {"block_hashes": [b"x" * 65]},
    {"block_hashes": "12"},
    {"token_ids": [-1, 2, 3, 4]},
    {"token_ids": [2**40, 2, 3, 4]},
    {"token_ids": [True, 2, 3, 4]},
    {"block_size": 0},
    {"lora_name": "a" * 1000},
    {"parent_block_hash": [1]},
    {"extra_keys": [["a"]]},  # one entry for two blocks
    {"extra_keys": [[[[[[[[[[[]]]]]]]]]] * 100]},
])
def test_a_known_event_with_bad_fields_raises_bad_event(fields):
    with pytest.raises(BadEvent, match="BlockStored"):
        decode(message([stored_map(**fields)]))


@given(st.binary(max_size=256))
def test_arbitrary_bytes_raise_only_bad_event(payload):
    try:
        decode([b"", SEQ, payload])
    except BadEvent:
        pass


hashes = st.one_of(st.integers(0, 2**64 - 1), st.binary(min_size=32, max_size=32))


@st.composite
def vllm_batches(draw):
    from vllm.distributed.kv_events import (
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        KVEventBatch,
    )
    events = []
    for kind in draw(st.lists(st.sampled_from("SRC"), max_size=6)):
        if kind == "S":
            n = draw(st.integers(1, 4))
            size = draw(st.sampled_from([1, 16]))
            lora = draw(st.one_of(st.none(), st.text(max_size=8)))
            events.append(BlockStored(
                block_hashes=draw(st.lists(hashes, min_size=n, max_size=n)),
                parent_block_hash=draw(st.one_of(st.none(), hashes)),
                token_ids=draw(st.lists(st.integers(0, 2**31 - 1), min_size=n * size,
                                        max_size=n * size)),
                block_size=size, lora_id=draw(st.one_of(st.none(), st.integers(1, 99))),
                medium=draw(st.sampled_from([None, "GPU", "CPU"])), lora_name=lora,
                group_idx=draw(st.one_of(st.none(), st.integers(0, 3))),
                extra_keys=draw(st.one_of(st.none(), st.just(
                    [(lora,) if lora is not None else None] * n)))))
        elif kind == "R":
            events.append(BlockRemoved(block_hashes=draw(st.lists(hashes, max_size=4)),
                                       medium=draw(st.sampled_from([None, "GPU"]))))
        else:
            events.append(AllBlocksCleared())
    return KVEventBatch(ts=draw(st.floats(0, 2e9)), events=events,
                        data_parallel_rank=draw(st.one_of(st.none(), st.integers(0, 7))))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=vllm_batches(), seq=st.integers(0, 2**64 - 1))
def test_whatever_vllm_publishes_decodes_to_the_same_content(batch, seq):
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    payload = msgspec.msgpack.Encoder().encode(batch)  # as ZmqEventPublisher does
    got = decode([b"topic", seq.to_bytes(8, "big"), payload])
    assert got.seq == seq and got.ts == batch.ts and got.skipped == 0
    assert got.data_parallel_rank == batch.data_parallel_rank
    assert len(got.events) == len(batch.events)
    for mine, theirs in zip(got.events, batch.events, strict=True):
        if isinstance(theirs, BlockStored):
            assert mine == Stored(
                block_hashes=tuple(theirs.block_hashes), parent=theirs.parent_block_hash,
                token_ids=tuple(theirs.token_ids), block_size=theirs.block_size,
                lora_name=theirs.lora_name, lora_id=theirs.lora_id, medium=theirs.medium,
                group_idx=theirs.group_idx,
                opaque=(False,) * len(theirs.block_hashes) if theirs.extra_keys else ())
        elif isinstance(theirs, BlockRemoved):
            assert mine == Removed(block_hashes=tuple(theirs.block_hashes),
                                   medium=theirs.medium, group_idx=theirs.group_idx)
        else:
            assert mine == Cleared()
