"""The router's subscriber against vLLM's own publisher (`ZmqEventPublisher`): events
become index entries, a gap is filled by vLLM's replay socket exactly, a gap the replay
cannot fill makes the replica start afresh, and nothing outlives `aclose`.

Gaps are made as a network makes them: the subscriber listens through a relay (a SUB
and a PUB socket in the test) that drops the batches a test names; the replay socket
is vLLM's, unrelayed."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from dpserve.router.kv.index import KVIndex
from dpserve.router.kv.sources import EventSource
from dpserve.router.kv.subscriber import Subscriber

kv_events = pytest.importorskip("vllm.distributed.kv_events")

BS = 4
TOPIC = "kv"


def stored(first: int, n: int, parent: int | None = None) -> object:
    """Blocks first..first+n-1 of a prompt whose token i is 1000 + i."""
    tokens = list(range(1000 + first * BS, 1000 + (first + n) * BS))
    return kv_events.BlockStored(block_hashes=list(range(first + 1, first + n + 1)),
                                 parent_block_hash=parent, token_ids=tokens, block_size=BS,
                                 lora_id=None, medium="GPU", lora_name=None)


PROMPT = list(range(1000, 1000 + 16 * BS))


async def until(condition: Callable[[], bool], what: str, within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {within_s:g} s: {what}")
        await asyncio.sleep(0.01)


class Relay:
    """vLLM's PUB socket -> this -> the subscriber, dropping the batches in `drop`."""

    def __init__(self, ctx: zmq.asyncio.Context, upstream: str, downstream: str) -> None:
        self.drop: set[int] = set()
        self.inject: list[list[bytes]] = []
        self.passed: list[int] = []
        self._sub = ctx.socket(zmq.SUB)
        self._sub.subscribe(b"")
        self._sub.connect(upstream)
        self._pub = ctx.socket(zmq.PUB)
        self._pub.bind(downstream)
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            frames = await self._sub.recv_multipart()
            while self.inject:
                await self._pub.send_multipart(self.inject.pop(0))
            seq = int.from_bytes(frames[1], "big")
            if seq not in self.drop:
                self.passed.append(seq)
                await self._pub.send_multipart(frames)

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._sub.close(linger=0)
        self._pub.close(linger=0)


class Rig:
    def __init__(self, publisher: object, relay: Relay, subscriber: Subscriber,
                 index: KVIndex) -> None:
        self.publisher, self.relay, self.subscriber, self.index = (publisher, relay,
                                                                   subscriber, index)
        self.sent = 0

    def publish(self, *events: object) -> int:
        self.publisher.publish(kv_events.KVEventBatch(ts=time.time(), events=list(events)))
        self.sent += 1
        return self.sent - 1

    def held(self) -> int:
        return self.index.cached_tokens(PROMPT, None).get("r0", 0) // BS

    async def connected(self) -> None:
        """Probe batches until one reaches the index (ZeroMQ subscriptions take effect
        some time after connecting): the index then follows from that batch."""
        async def seen() -> bool:
            self.publish(kv_events.BlockRemoved(block_hashes=[10_000 + self.sent],
                                                medium="GPU"))
            await asyncio.sleep(0.02)
            return self.subscriber.stats().get("r0") is not None and (
                self.subscriber.stats()["r0"].batches > 0)
        deadline = time.monotonic() + 10
        while not await seen():
            assert time.monotonic() < deadline, "the subscriber never received a batch"


@contextlib.asynccontextmanager
async def rig(tmp_path: Path, *, buffer_steps: int = 100, replay: bool = True
              ) -> AsyncIterator[Rig]:
    ctx = zmq.asyncio.Context()
    publisher = kv_events.ZmqEventPublisher(
        data_parallel_rank=0, endpoint=f"ipc://{tmp_path}/pub",
        replay_endpoint=f"ipc://{tmp_path}/replay" if replay else None,
        buffer_steps=buffer_steps, topic=TOPIC)
    relay = Relay(ctx, f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/relay")
    index = KVIndex()
    subscriber = Subscriber(index, context=ctx, replay_timeout_s=2.0)
    subscriber.start("r0", EventSource(f"ipc://{tmp_path}/relay",
                                       f"ipc://{tmp_path}/replay" if replay else None, TOPIC))
    r = Rig(publisher, relay, subscriber, index)
    try:
        await r.connected()
        yield r
    finally:
        await subscriber.aclose()
        await relay.close()
        publisher.shutdown()
        ctx.destroy(linger=0)


async def test_blocks_an_engine_stores_become_a_cached_prefix_and_removed_ones_leave_it(
        tmp_path):
    async with rig(tmp_path) as r:
        r.publish(stored(0, 4))
        r.publish(stored(4, 4, parent=4))
        await until(lambda: r.held() == 8, "8 blocks held")
        r.publish(kv_events.BlockRemoved(block_hashes=[6], medium="GPU"))
        await until(lambda: r.held() == 5, "the prefix cut at the removed block")
        r.publish(kv_events.AllBlocksCleared())
        await until(lambda: r.held() == 0, "nothing held after a reset")
        assert r.subscriber.stats()["r0"].malformed == 0


async def test_a_missed_batch_is_replayed_and_the_index_is_exact(tmp_path):
    async with rig(tmp_path) as r:
        r.relay.drop = {r.sent + 1}
        r.publish(stored(0, 4))
        r.publish(stored(4, 4, parent=4))  # dropped on the way
        r.publish(kv_events.BlockRemoved(block_hashes=[2], medium="GPU"))
        r.publish(stored(8, 1, parent=8))
        stats = r.subscriber.stats()["r0"]
        await until(lambda: stats.replays == 1, "the gap replayed")
        await until(lambda: r.index.stats()["r0"].blocks >= 8, "every block applied")
        assert r.held() == 1  # block 2 removed: the prefix holds block 1 only
        assert not r.index.stats()["r0"].stale and stats.resyncs == 0


async def test_a_gap_older_than_the_replay_buffer_starts_the_replica_afresh(tmp_path):
    async with rig(tmp_path, buffer_steps=2) as r:
        r.publish(stored(0, 4))
        await until(lambda: r.held() == 4, "4 blocks held")
        gone = {r.sent, r.sent + 1, r.sent + 2}
        r.relay.drop = gone
        for _ in gone:
            r.publish(kv_events.BlockRemoved(block_hashes=[1], medium="GPU"))
        r.publish(stored(9, 1, parent=None))  # shows the gap; not part of the prompt
        stats = r.subscriber.stats()["r0"]
        await until(lambda: stats.resyncs == 1, "a resync")
        # What it held before the gap is forgotten (block 1 was in fact removed), and
        # the batch that showed the gap starts the replica afresh.
        assert r.held() == 0 and r.index.stats()["r0"].blocks == 1
        r.publish(stored(0, 2))
        await until(lambda: r.held() == 2, "followed afresh from the next batch")
        assert not r.index.stats()["r0"].stale


async def test_without_a_replay_socket_a_gap_starts_the_replica_afresh(tmp_path):
    async with rig(tmp_path, replay=False) as r:
        r.publish(stored(0, 4))
        await until(lambda: r.held() == 4, "4 blocks held")
        r.relay.drop = {r.sent}
        r.publish(kv_events.BlockRemoved(block_hashes=[1], medium="GPU"))
        r.publish(stored(0, 2))
        await until(lambda: r.subscriber.stats()["r0"].resyncs == 1, "a resync")
        await until(lambda: r.held() == 2, "followed afresh")


@pytest.mark.parametrize("frames", [
    [b"kv", b"\x00" * 8],
    [b"kv", b"\x00" * 7, b"\x90"],
    [b"kv", (10**6).to_bytes(8, "big"), b"\xc1"],
    [b"kv", (10**6).to_bytes(8, "big"), b"\x92\xcb\x7f\xf8\x00\x00\x00\x00\x00\x00\x90"],
])
async def test_undecodable_messages_are_counted_and_skipped(tmp_path, frames):
    async with rig(tmp_path) as r:
        r.relay.inject.append(frames)
        r.publish(stored(0, 3))
        stats = r.subscriber.stats()["r0"]
        await until(lambda: r.held() == 3, "the next batch applied")
        assert stats.malformed == 1 and stats.resyncs == 0


async def test_stopping_drops_the_replica_and_aclose_leaves_no_task(tmp_path):
    async with rig(tmp_path) as r:
        r.publish(stored(0, 4))
        await until(lambda: r.held() == 4, "4 blocks held")
        r.subscriber.stop("r0")
        assert "r0" not in r.index.stats() and r.subscriber.stats() == {}
        r.subscriber.start("r0", EventSource(f"ipc://{tmp_path}/relay", None, TOPIC))
    assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("dpserve-kv-")]


async def test_lag_and_delay_are_reported(tmp_path):
    async with rig(tmp_path) as r:
        stats = r.subscriber.stats()["r0"]
        assert stats.lag_s is not None and 0 <= stats.lag_s < 10
        assert stats.delay_s is not None and 0 <= stats.delay_s < 10
