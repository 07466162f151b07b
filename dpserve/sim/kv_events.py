"""A simulated replica's KV-cache events, published over ZMQ as vLLM 0.32 publishes them.

With `SimConfig.kv_events`, every engine step that changed the prefix cache sends one
batch, so a router can follow what each replica holds exactly as it would follow a
real vLLM (`dpserve/router/kv/events.py` decodes it and documents the format):

- `BlockStored` when full blocks are named (prompt or generated), one event per
  sequence and run of consecutive new blocks: their hashes, the hash of the block
  before them (None for a prompt's first block), their token ids, `block_size`,
  `medium="GPU"`, `group_idx=0` (one KV-cache group), `kv_cache_spec_kind`
  "full_attention", per block `extra_keys` (None, or the LoRA adapter's name), and the
  adapter's `lora_id` and `lora_name` for a request under one;
- `BlockRemoved` for each block evicted, one event per block, as vLLM sends them;
- `AllBlocksCleared` after `Engine.reset_prefix_cache` (a weight reload's reset), with
  the next step's events. A replica that stops and starts again is a new publisher,
  numbering its batches from 0 again, which a subscriber takes as a restart.

The structs below mirror vLLM's (`vllm/distributed/kv_events.py`) field for field, in
the same order and with the same options (the batch an array, events maps tagged by
class name, default values left out), so msgspec writes the same bytes; the simulator
must not import vLLM. Block hashes are vLLM's own for the same token ids
(`prefix_cache.block_hashes`: SHA-256 digests, vLLM 0.32's default), sent as vLLM's
engine sends them by default (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`): each digest's
last 8 bytes as an unsigned big-endian int (`wire_hash`, vLLM's
`maybe_convert_block_hash`), the same ints for the same token ids and PYTHONHASHSEED.

Sockets, on 127.0.0.1, as `ZmqEventPublisher` binds them for a `tcp://*:PORT`
endpoint: a PUB socket sends ``[topic, seq (8 bytes, big-endian), payload]``, seq
counting from 0; a ROUTER socket on the next port answers a replay request (one frame,
the first seq wanted, 8 bytes big-endian) with every buffered batch from there,
``[b"", topic, seq, payload]`` each, then ``[b"", b"", -1 as 8 signed bytes, b""]``.
The last `kv_events_buffer_steps` batches are kept for replay.

Nothing here can stall the engine: at the end of a step the engine's task encodes the
batch (microseconds) and hands it to ZMQ's I/O thread without waiting, and a
subscriber that does not read loses batches once the PUB socket's high-water mark
(`kv_events_hwm`) is reached, as with vLLM (it then asks the replay for what it
missed). A replay runs in its own task, yields
to the engines between messages and gives up on a client after `REPLAY_TIMEOUT_S`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

import msgspec
import zmq
import zmq.asyncio

from dpserve.sim.config import SimConfig

if TYPE_CHECKING:
    from dpserve.sim.adapters import Adapter

log = logging.getLogger("dpserve.sim")

MEDIUM_GPU: Final = "GPU"
FULL_ATTENTION: Final = "full_attention"
"""The `kv_cache_spec_kind` vLLM's KV-cache manager stamps on a full-attention group's
stores (`KVCacheSpecKind.FULL_ATTENTION`); its sliding window stays None."""
MAX_QUEUE_SIZE: Final = 100_000
"""vLLM's default `max_queue_size` (events queued for its publisher thread), reported
by `/kv_event_sources`. The simulator has no such queue: it sends from the step."""
END_SEQ: Final = (-1).to_bytes(8, "big", signed=True)
"""The sequence frame of the replay's end marker."""
REPLAY_TIMEOUT_S: Final = 10.0
"""Longest one replay may take: a client that stops reading mid-replay is dropped."""
REPLAY_CHUNK: Final = 64
"""Batches a replay sends before letting the engines' steps run."""
_U64: Final = (1 << 64) - 1


def wire_hash(h: int) -> int:
    """A block hash as published: the digest's low 64 bits (`prefix_cache` keeps a
    digest as the int its bytes spell big-endian), exactly the int vLLM's
    `maybe_convert_block_hash` makes of its `BlockHash`. Any other int (a benchmark's
    made-up block names) is masked to 64 bits the same way."""
    return h & _U64


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the events: tagged by class name, so the class names are the wire's."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


def stored(hashes: list[int], parent: int | None, token_ids: list[int], block_size: int,
           lora_id: int | None = None, lora_name: str | None = None) -> BlockStored:
    """The event for newly named blocks on the GPU, in KV-cache group 0 (full attention),
    as vLLM 0.32's block pool and KV-cache manager write it: `extra_keys` one entry per
    block, the adapter's name alone (``(lora_name,)``) under a LoRA adapter, else None."""
    keys: tuple[Any, ...] | None = None if lora_name is None else (lora_name,)
    return BlockStored(block_hashes=[wire_hash(h) for h in hashes],
                       parent_block_hash=None if parent is None else wire_hash(parent),
                       token_ids=token_ids, block_size=block_size, lora_id=lora_id,
                       medium=MEDIUM_GPU, lora_name=lora_name,
                       extra_keys=[keys] * len(hashes), group_idx=0,
                       kv_cache_spec_kind=FULL_ATTENTION)


def stored_runs(blocks: list[int], hashes: list[int], token_ids: Callable[[int, int], list[int]],
                block_size: int, lora: Adapter | None = None) -> list[BlockStored]:
    """`BlockStored` events for the newly named blocks `blocks` (indices into `hashes`,
    a sequence's chain; `token_ids(start, end)` its tokens; `lora` its adapter): one per
    run of consecutive blocks, each the child of the block before it (None for a
    prompt's first)."""
    lora_id, lora_name = (None, None) if lora is None else (lora.id, lora.name)
    events: list[BlockStored] = []
    start = 0
    for i in range(1, len(blocks) + 1):
        if i == len(blocks) or blocks[i] != blocks[i - 1] + 1:
            first, end = blocks[start], blocks[i - 1] + 1
            events.append(stored(hashes[first:end], hashes[first - 1] if first else None,
                                 token_ids(first * block_size, end * block_size), block_size,
                                 lora_id, lora_name))
            start = i
    return events


def removed(h: int) -> BlockRemoved:
    return BlockRemoved(block_hashes=[wire_hash(h)], medium=MEDIUM_GPU, group_idx=0)


class KVEventPublisher:
    """One replica's PUB and replay sockets. `bind` them (inside the event loop), hand
    `publish` to the engine, `close` when done."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.endpoint: str | None = None
        """Where a subscriber connects its SUB socket: ``tcp://127.0.0.1:PORT``."""
        self.replay_endpoint: str | None = None
        """Where a client connects a DEALER or REQ socket to ask for missed batches."""
        self.next_seq = 0
        """The sequence number of the next batch: how many were published."""
        self._topic = config.kv_events_topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.kv_events_buffer_steps)
        self._encoder = msgspec.msgpack.Encoder()
        self._pub: zmq.Socket[bytes] | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None

    def bind(self, port: int, context: zmq.asyncio.Context) -> None:
        """Bind the PUB socket to `port` and the replay socket to `port + 1`; with 0,
        to ports the OS picks. The sockets live in `context`, which must outlive them
        (`close` them first). Raises OSError if a port is taken."""
        if self._pub is not None:
            raise RuntimeError("this publisher is bound already")
        # A plain socket for PUB (sends never wait); an asyncio one for the replay.
        pub: zmq.Socket[bytes] = zmq.Context.shadow(context.underlying).socket(zmq.PUB)
        replay = context.socket(zmq.ROUTER)
        self._pub, self._replay = pub, replay
        try:
            pub.setsockopt(zmq.SNDHWM, self.config.kv_events_hwm)
            pub.setsockopt(zmq.LINGER, 0)
            # Refuse rather than drop a reply a client cannot take yet: the replay waits.
            replay.setsockopt(zmq.ROUTER_MANDATORY, 1)
            replay.setsockopt(zmq.LINGER, 0)
            self.endpoint = _bind(pub, port)
            self.replay_endpoint = _bind(replay, port + 1 if port else 0)
        except BaseException:
            self._close_sockets()
            raise
        self._replay_task = asyncio.get_running_loop().create_task(
            self._serve_replays(), name=f"sim-kv-replay-{self.endpoint}")

    def publish(self, events: list[Event]) -> None:
        """Send one engine step's events as the next batch (never blocks)."""
        if self._pub is None:
            return
        seq = self.next_seq
        self.next_seq += 1
        payload = self._encoder.encode(
            KVEventBatch(ts=time.time(), events=events, data_parallel_rank=0))
        seq_bytes = seq.to_bytes(8, "big")
        # PUB drops for a subscriber at its high-water mark instead of blocking.
        with contextlib.suppress(zmq.Again):
            self._pub.send_multipart((self._topic, seq_bytes, payload), flags=zmq.NOBLOCK)
        self._buffer.append((seq, payload))

    def sources(self) -> dict[str, dict[str, Any]]:
        """The body of `GET /kv_event_sources`: vLLM's `KVEventsConfig` per data-parallel
        rank (one here), as an engine started with `tcp://*:PORT` answers: the port on
        a wildcard host, which a subscriber reaches on the replica's own host (the
        sockets are bound on loopback, where the simulated replicas listen)."""
        c = self.config
        return {"0": {"enable_kv_cache_events": True, "publisher": "zmq",
                      "endpoint": _wildcard(self.endpoint),
                      "replay_endpoint": _wildcard(self.replay_endpoint),
                      "buffer_steps": c.kv_events_buffer_steps, "hwm": c.kv_events_hwm,
                      "max_queue_size": MAX_QUEUE_SIZE, "topic": c.kv_events_topic}}

    async def close(self) -> None:
        """Stop answering replays and close the sockets. Idempotent."""
        if self._replay_task is not None:
            self._replay_task.cancel()
            await asyncio.gather(self._replay_task, return_exceptions=True)
            self._replay_task = None
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._replay = None

    async def _serve_replays(self) -> None:
        assert self._replay is not None
        replay = self._replay
        while True:
            frames = await replay.recv_multipart()
            if len(frames) != 3:  # vLLM ignores it too: [identity, b"", start seq]
                log.warning("invalid KV-event replay request of %d frames", len(frames))
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            try:
                async with asyncio.timeout(REPLAY_TIMEOUT_S):
                    for n, (seq, payload) in enumerate(list(self._buffer)):
                        if seq >= start_seq:
                            await replay.send_multipart(
                                (client, b"", self._topic, seq.to_bytes(8, "big"), payload))
                        if n % REPLAY_CHUNK == REPLAY_CHUNK - 1:
                            await asyncio.sleep(0)  # a send that need not wait does not yield
                    await replay.send_multipart((client, b"", b"", END_SEQ, b""))
            except (TimeoutError, zmq.ZMQError) as exc:  # slow or gone
                log.warning("KV-event replay to a client abandoned: %s", exc or "timed out")


def _wildcard(endpoint: str | None) -> str | None:
    """`tcp://127.0.0.1:PORT` as vLLM reports a wildcard bind: `tcp://*:PORT`."""
    return None if endpoint is None else "tcp://*:" + endpoint.rsplit(":", 1)[1]


def _bind(sock: zmq.Socket[Any], port: int) -> str:
    """Bind and return the endpoint bound; OSError, as for an HTTP port, if it is taken."""
    address = f"tcp://127.0.0.1:{port or '*'}"
    try:
        sock.bind(address)
    except zmq.ZMQError as exc:
        raise OSError(exc.errno, f"cannot bind KV events to {address}: {exc.strerror}") from None
    endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
    assert isinstance(endpoint, bytes)
    return endpoint.decode()
