"""Per-replica CPU and memory, read from the replicas' process trees at scrape time.

Where no GPU exists (CPU replicas), this is the utilization a dashboard shows
in place of the GPU panels. A replica is its process tree: vLLM's API server
(the pid the supervisor started) and the engine-core process it spawns, so
values are summed over the tree.

- `dpserve_replica_cpu_seconds_total` — CPU time (user + system) of the tree; take
  `rate()` of it for utilization over any window.
- `dpserve_replica_cpu_utilization_ratio` — CPU time since the previous scrape
  divided by wall time and by the cores the replica is bound to (0 to 1, the
  analogue of `dpserve_gpu_utilization_ratio`; above 1 when its threads run
  beyond those cores); on a replica's first scrape, the average since it started.
- `dpserve_replica_memory_rss_bytes` — resident memory of the tree (pages shared
  between its processes are counted in each, so it is an upper bound).

Listing a tree means scanning every process of the host, so a tree is
remembered and listed again only when its root changes, one of its processes
exits, or `TREE_REFRESH_S` has passed. A process that exits mid-scrape is left
out of that scrape; /metrics never fails because of it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import psutil
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

TREE_REFRESH_S = 10.0
_GONE = (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied)


def cpuset_size(cpus: str) -> int:
    """Number of cores in a cpuset list such as `0-3,8` (what `cpu:` devices name)."""
    n = 0
    for part in cpus.split(","):
        first, _, last = part.strip().partition("-")
        if first.isdigit():
            n += int(last) - int(first) + 1 if last.isdigit() else 1
    return n


def replica_cores(devices: Iterable[tuple[str, str]], default: int) -> dict[str, int]:
    """Cores each replica may use, from (replica id, device) pairs: `cpu:0,1` → 2."""
    cores = {}
    for replica_id, device in devices:
        kind, _, cpus = device.partition(":")
        cores[replica_id] = (cpuset_size(cpus) if kind == "cpu" else 0) or default
    return cores


@dataclass
class _Tree:
    root: int
    procs: list[psutil.Process]
    listed_at: float
    last_cpu: float | None = None
    last_at: float = field(default_factory=time.monotonic)


class ProcessCollector(Collector):
    """Prometheus collector of each replica's process tree.

    `pids()` gives the current root pid of each replica (the supervisor's
    `Supervisor.pids`); `cores` the number of cores each is bound to.
    """

    def __init__(self, pids: Callable[[], Mapping[str, int]],
                 cores: Mapping[str, int] | None = None) -> None:
        self._pids = pids
        self._cores = dict(cores or {})
        self._trees: dict[str, _Tree] = {}

    def describe(self) -> Iterable[Metric]:
        return self._families()

    @staticmethod
    def _families() -> tuple[CounterMetricFamily, GaugeMetricFamily, GaugeMetricFamily]:
        return (
            CounterMetricFamily("dpserve_replica_cpu_seconds",
                                "CPU time used by the replica's processes.",
                                labels=["replica"]),
            GaugeMetricFamily("dpserve_replica_cpu_utilization_ratio",
                              "CPU time since the previous scrape / wall time / cores the "
                              "replica is bound to.", labels=["replica"]),
            GaugeMetricFamily("dpserve_replica_memory_rss_bytes",
                              "Resident memory of the replica's processes, summed.",
                              labels=["replica"]),
        )

    def collect(self) -> Iterable[Metric]:
        cpu_seconds, utilization, rss = families = self._families()
        pids = self._pids()
        for gone in self._trees.keys() - pids.keys():
            del self._trees[gone]
        now = time.monotonic()
        for replica_id, pid in sorted(pids.items()):
            sample = self._sample(replica_id, pid, now)
            if sample is None:
                continue
            cpu, memory, ratio = sample
            cpu_seconds.add_metric([replica_id], cpu)
            rss.add_metric([replica_id], memory)
            utilization.add_metric([replica_id], ratio)
        return families

    def _sample(self, replica_id: str, pid: int, now: float) -> tuple[float, float, float] | None:
        """(CPU seconds, RSS bytes, utilization) of the replica's tree; None if its root is gone."""
        tree = self._trees.get(replica_id)
        if tree is None or tree.root != pid or now - tree.listed_at > TREE_REFRESH_S:
            tree = self._list(replica_id, pid, now, tree)
            if tree is None:
                return None
        totals = self._read(tree)
        if totals is None:  # a process exited: list the tree again, once
            tree = self._list(replica_id, pid, now, tree)
            totals = None if tree is None else self._read(tree)
            if tree is None or totals is None:
                return None
        cpu, memory = totals
        cores = self._cores.get(replica_id) or psutil.cpu_count() or 1
        if tree.last_cpu is None:
            try:
                elapsed = max(time.time() - tree.procs[0].create_time(), 1e-3)
            except _GONE:
                return None
            used = cpu
        else:
            elapsed = max(now - tree.last_at, 1e-3)
            used = max(cpu - tree.last_cpu, 0.0)  # a child that exited takes its time along
        tree.last_cpu, tree.last_at = cpu, now
        return cpu, memory, used / elapsed / cores

    def _list(self, replica_id: str, pid: int, now: float, old: _Tree | None) -> _Tree | None:
        try:
            root = psutil.Process(pid)
            procs = [root, *root.children(recursive=True)]
        except _GONE:
            self._trees.pop(replica_id, None)
            return None
        tree = _Tree(root=pid, procs=procs, listed_at=now)
        if old is not None and old.root == pid:  # same replica process: keep its CPU baseline
            tree.last_cpu, tree.last_at = old.last_cpu, old.last_at
        self._trees[replica_id] = tree
        return tree

    @staticmethod
    def _read(tree: _Tree) -> tuple[float, float] | None:
        cpu = memory = 0.0
        for proc in tree.procs:
            try:
                with proc.oneshot():
                    times = proc.cpu_times()
                    cpu += times.user + times.system + times.children_user + times.children_system
                    memory += proc.memory_info().rss
            except _GONE:
                return None
        return cpu, memory
