"""The work each worker sent to each replica lately, in memory every worker maps.

`prefix-affinity` sends new work where the least went lately (`RecentWork`). Two
workers that each knew only their own sends, or learned the other's over the
socket pair (0.1 to 4 ms later on a busy 2-core machine), picked the same replica
for requests that arrived a millisecond apart: 25 of 400 picks broke the round
robin a single process keeps, and p99 TTFT rose 15% (benchmarks/routing/README.md). So the
counts live in a shared table instead, read at the moment of every choice.

Layout: one row per worker, one cell per replica slot (the leader numbers the
replicas; the table's rows carry the number), each cell two doubles: the decayed
work and when it was last updated. A worker writes only its own row; readers sum
the rows. A reader may see a cell half-written (the value new, the time old): a
heuristic's input off for one choice, never a crash. The memory is a memfd the
leader creates and hands to each follower it starts.
"""

from __future__ import annotations

import math
import mmap
import os
from collections.abc import Callable

from dpserve.router.fleet.pool import Replica
from dpserve.router.routing.policies import Shared
from dpserve.router.routing.policies.recent_work import RecentWork

MAX_SLOTS = 1024
"""Replicas numbered per router (discovery may add more over time; past this many,
the rest are counted per worker)."""


class WorkTable:
    def __init__(self, fd: int, *, workers: int, me: int) -> None:
        self.fd = fd
        self.workers = workers
        self._me = me
        self._map = mmap.mmap(fd, workers * MAX_SLOTS * 16)
        self._cells = memoryview(self._map).cast("d")
        self._mine = me * MAX_SLOTS * 2

    @classmethod
    def create(cls, workers: int) -> WorkTable:
        """A zeroed table for `workers` workers, this process being worker 0."""
        fd = os.memfd_create("dpserve-recent-work", 0)
        os.ftruncate(fd, workers * MAX_SLOTS * 16)
        return cls(fd, workers=workers, me=0)

    def add(self, slot: int, units: float, now: float, rate: float) -> None:
        i = self._mine + 2 * slot
        cells = self._cells
        cells[i] = cells[i] * math.exp(-rate * (now - cells[i + 1])) + units
        cells[i + 1] = now

    def work(self, slot: int, now: float, rate: float) -> float:
        cells = self._cells
        total = 0.0
        for row in range(self.workers):
            i = (row * MAX_SLOTS + slot) * 2
            value = cells[i]
            if value:
                total += value * math.exp(-rate * (now - cells[i + 1]))
        return total

    def close(self) -> None:
        self._cells.release()
        self._map.close()


class SharedRecentWork(RecentWork):
    """`RecentWork` whose counts are every worker's: replicas with a slot in `slots`
    are read from and charged to the shared table."""

    def __init__(self, table: WorkTable, slots: dict[str, int], *, half_life_s: float,
                 clock: Callable[[], float]) -> None:
        super().__init__(half_life_s=half_life_s, clock=clock)
        self._table = table
        self.slots = slots

    def work(self, replica: Replica, now: float) -> float:
        slot = self.slots.get(replica.id)
        if slot is None:
            return super().work(replica, now)
        return self._table.work(slot, now, self._rate)

    def add(self, replica_id: str, units: float) -> None:
        slot = self.slots.get(replica_id)
        if slot is None:
            super().add(replica_id, units)
        else:
            self._table.add(slot, units, self._clock(), self._rate)


def share(memory: Shared, work: WorkTable | None, slots: dict[str, int], *,
          on_journal: Callable[[], None]) -> None:
    """Make a worker's routing memory the workers' own: its journal kept (and
    `on_journal` told of each first entry), its recent work in `work` when there is one
    (`slots` numbering the replicas, filled as the leader numbers them)."""
    memory.journal()  # start keeping one
    memory.on_journal = on_journal
    if work is not None:
        memory.share_work(SharedRecentWork(work, slots, half_life_s=memory.half_life_s,
                                           clock=memory.clock))
