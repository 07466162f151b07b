"""The router's subscription to each replica's KV-cache events: a ZeroMQ SUB socket per
replica, every batch decoded (`dpserve.router.kv.events`) and applied to the shared
:class:`~dpserve.router.kv.index.KVIndex` on the router's event loop.

**Gaps.** The index numbers each replica's batches; a batch that skips numbers (the
SUB socket's high-water mark dropped some, or the publisher's) leaves the replica
stale, scoring nothing. The subscriber then asks the replica's replay socket for the
batches from the first one missing, applies them in order, and goes on with the live
stream (batches it already has are ignored by the index). When the replay cannot fill
the gap (no replay socket, the batches are older than the engine's buffer, no answer
within `replay_timeout_s`), it *resyncs*: the replica's entries are dropped and it
starts again from the next live batch. From then on the index knows only blocks stored
since: it underestimates what the replica holds, and never routes to blocks it lost.

**The event loop.** Decoding and applying happen on the loop, one batch at a time, with
a yield after each: a replica flooding events delays other work by one batch at most.
A batch is bounded (`MAX_BATCH_BYTES`) below the decoder's own limit, so that one
batch's work stays short (`benchmarks/routing/kv_index.py` measures it).

SUB sockets connect in the background and reconnect by themselves; a replica that is
not up yet costs nothing until it is. The slow-joiner problem (batches published before
the subscription took effect are never seen) is the index's "starts from the first
batch seen".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from dpserve.router.kv.events import END_SEQ, BadEvent, Batch, decode
from dpserve.router.kv.index import KVIndex
from dpserve.router.kv.sources import EventSource

log = logging.getLogger("dpserve.router")

MAX_BATCH_BYTES = 4 * 1024 * 1024
"""A batch larger than this is skipped, counted as malformed (and leaves a gap that the
replay cannot fill: a resync). One engine step's batch is a few KiB; a 128k-token
prefill in 16-token blocks is under 1 MiB."""
RECEIVE_HWM = 10_000
"""Batches queued unread per replica before ZeroMQ drops (then a gap, then a replay)."""
REPLAY_TIMEOUT_S = 5.0
"""Longest wait for each frame of a replay."""


@dataclass(slots=True)
class FeedStats:
    """One replica's feed, for `/metrics` and the admin API (counters since it began)."""

    endpoint: str
    batches: int = 0
    """Batches applied (live or replayed)."""
    replays: int = 0
    """Gaps filled by the replay socket."""
    resyncs: int = 0
    """Gaps it could not fill: the replica's entries dropped, followed afresh."""
    malformed: int = 0
    """Messages that could not be decoded, skipped."""
    last_at: float | None = None
    """`time.monotonic()` when the last batch was applied."""
    since: float = field(default_factory=time.monotonic)
    """When the replica began to be followed."""
    delay_s: float | None = None
    """The last batch's time from its publisher's clock to being applied."""

    @property
    def lag_s(self) -> float:
        """Seconds since the last batch was applied, or since the replica began to be
        followed if none was (an idle engine publishes none)."""
        return time.monotonic() - (self.last_at if self.last_at is not None else self.since)


class Subscriber:
    """One subscription per followed replica, all feeding `index`."""

    def __init__(self, index: KVIndex, *, context: zmq.asyncio.Context | None = None,
                 replay_timeout_s: float = REPLAY_TIMEOUT_S,
                 receive_hwm: int = RECEIVE_HWM) -> None:
        self.index = index
        self._own_context = context is None
        self._context = context if context is not None else zmq.asyncio.Context()
        self._replay_timeout_s = replay_timeout_s
        self._hwm = receive_hwm
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._stats: dict[str, FeedStats] = {}

    def start(self, replica_id: str, source: EventSource) -> None:
        """Follow `replica_id`'s events from `source`, afresh (what was known of it is
        dropped)."""
        self.stop(replica_id)
        stats = self._stats[replica_id] = FeedStats(source.endpoint)
        self._tasks[replica_id] = asyncio.get_running_loop().create_task(
            self._follow(replica_id, source, stats), name=f"dpserve-kv-{replica_id}")

    def stop(self, replica_id: str) -> None:
        """Stop following `replica_id` and drop what the index holds of it."""
        task = self._tasks.pop(replica_id, None)
        if task is not None:
            task.cancel()
        self._stats.pop(replica_id, None)
        self.index.drop(replica_id)

    def stats(self) -> dict[str, FeedStats]:
        return dict(self._stats)

    async def aclose(self) -> None:
        tasks = list(self._tasks.values())
        for replica_id in list(self._tasks):
            self.stop(replica_id)
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._own_context:
            self._context.destroy(linger=0)

    async def _follow(self, replica_id: str, source: EventSource, stats: FeedStats) -> None:
        sub = self._context.socket(zmq.SUB)
        try:
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.RCVHWM, self._hwm)
            sub.setsockopt(zmq.MAXMSGSIZE, MAX_BATCH_BYTES + 4096)
            sub.subscribe(source.topic.encode())
            sub.connect(source.endpoint)
            while True:
                batch = self._decode(replica_id, await sub.recv_multipart(), stats)
                if batch is not None:
                    missing = self._applied(replica_id, batch, stats)
                    if missing is not None:
                        await self._heal(replica_id, source, missing, batch, stats)
                await asyncio.sleep(0)  # a flood's next batch waits its turn
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug must not leave the replica believed exact
            log.exception("replica %s: KV-event feed failed; its entries are dropped",
                          replica_id)
            self.index.drop(replica_id)
        finally:
            sub.close(linger=0)

    @staticmethod
    def _decode(replica_id: str, frames: list[bytes], stats: FeedStats) -> Batch | None:
        try:
            return decode(frames)
        except BadEvent as exc:
            stats.malformed += 1
            if stats.malformed == 1:
                log.warning("replica %s: undecodable KV-event message skipped: %s",
                            replica_id, exc)
            return None

    def _applied(self, replica_id: str, batch: Batch, stats: FeedStats) -> int | None:
        """Apply one batch; the first one missing if the replica is now stale."""
        missing = self.index.apply(replica_id, batch.seq, batch.events, skipped=batch.skipped)
        stats.batches += 1
        stats.last_at = time.monotonic()
        stats.delay_s = max(0.0, time.time() - batch.ts)
        return missing

    async def _heal(self, replica_id: str, source: EventSource, missing: int, batch: Batch,
                    stats: FeedStats) -> None:
        """Fill the gap from `missing` through the replay socket, or resync: drop the
        replica and follow it from `batch` (the one that showed the gap)."""
        if source.replay_endpoint is not None and await self._replay(
                replica_id, source.replay_endpoint, missing, stats):
            stats.replays += 1
            return
        stats.resyncs += 1
        log.warning("replica %s: KV events from batch %d missed and not replayable; "
                    "following it afresh", replica_id, missing)
        self.index.drop(replica_id)
        self._applied(replica_id, batch, stats)

    async def _replay(self, replica_id: str, endpoint: str, start: int,
                      stats: FeedStats) -> bool:
        """Ask for every buffered batch from `start`; whether the replica is exact after."""
        dealer = self._context.socket(zmq.DEALER)
        try:
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.MAXMSGSIZE, MAX_BATCH_BYTES + 4096)
            dealer.connect(endpoint)
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            expected: int | None = start
            while True:
                if not await dealer.poll(int(self._replay_timeout_s * 1000)):
                    return False
                frames = await dealer.recv_multipart()
                if len(frames) != 4 or frames[0]:
                    stats.malformed += 1
                    return False
                if frames[2] == END_SEQ:
                    return expected is None
                if expected is not None:
                    seq = int.from_bytes(frames[2], "big")
                    if seq > expected:
                        return False  # older than the engine's buffer: lost for good
                    replayed = self._decode(replica_id, frames[1:], stats)
                    if replayed is None:
                        return False
                    missing = self._applied(replica_id, replayed, stats)
                    expected = None if missing is None else max(expected, missing)
                await asyncio.sleep(0)
        finally:
            dealer.close(linger=0)
