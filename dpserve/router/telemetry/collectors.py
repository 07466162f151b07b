"""The router's metrics read at scrape time from live state (`dpserve.router.telemetry.metrics`
declares the rest): the pool's replicas, the router's demand, and its workers."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dpserve.router.fleet.pool import ReplicaPool, ReplicaState


class PoolCollector(Collector):
    """Gauges read from the pool at scrape time."""

    def __init__(self, pool: ReplicaPool) -> None:
        self._pool = pool

    def collect(self) -> Iterable[Metric]:
        in_flight = GaugeMetricFamily(
            "dpserve_replica_in_flight_requests",
            "Requests the router has in flight on each replica.",
            labels=["replica"],
        )
        state = GaugeMetricFamily(
            "dpserve_replica_state",
            "1 for the state each replica is in, 0 for the others.",
            labels=["replica", "state"],
        )
        ready = GaugeMetricFamily(
            "dpserve_replicas_ready", "Replicas currently receiving requests."
        )
        for r in self._pool:
            in_flight.add_metric([r.id], r.in_flight)
            for s in ReplicaState:
                state.add_metric([r.id, s.value], 1.0 if r.state is s else 0.0)
        ready.add_metric([], len(self._pool.ready()))
        return [in_flight, state, ready]


class WeightVersionCollector(Collector):
    """`dpserve_replica_weight_info{replica,version} 1`: which weights each replica serves,
    read from the pool at scrape time. One series per replica (the old version's series
    disappears when it changes), so the label stays bounded by the fleet size."""

    def __init__(self, pool: ReplicaPool) -> None:
        self._pool = pool

    def collect(self) -> Iterable[Metric]:
        info = GaugeMetricFamily(
            "dpserve_replica_weight_info",
            "1 for the weight version each replica serves (`unknown` while it is not known).",
            labels=["replica", "version"],
        )
        for r in self._pool:
            info.add_metric([r.id, r.weight_version or "unknown"], 1.0)
        return [info]


class DemandCollector(Collector):
    """`dpserve_requests_outstanding`: the requests this router holds, waiting in its queue
    or in flight on a replica, read at scrape time (the queue depth as last refreshed).

    This is the engines' autoscaling signal (deploy/k8s/components/autoscaling): summed
    over routers it is the fleet's demand, and replicas needed = demand / the requests
    one engine serves well. In flight already holds what an engine queues
    (`vllm:num_requests_waiting`: the router's request is open until the engine
    answers), so adding that would count it twice. Unlike a waiting count, which is 0
    whenever the fleet keeps up, demand stays proportional to load: it also tells the
    autoscaler how far it may scale down. Replicas draining, reloading or leaving
    (removed from the pool, their requests still finishing) count: what they run is
    still demand."""

    def __init__(self, pool: ReplicaPool, queue_depth: Gauge) -> None:
        self._pool = pool
        self._queue_depth = queue_depth

    def collect(self) -> Iterable[Metric]:
        queued = sum(s.value for m in self._queue_depth.collect() for s in m.samples)
        demand = GaugeMetricFamily(
            "dpserve_requests_outstanding",
            "Requests this router holds: waiting in its queue plus in flight on a replica "
            "(the engines' autoscaling signal; sum over routers).",
        )
        held = sum(r.in_flight for r in self._pool) + sum(
            r.in_flight for r in self._pool.leaving())
        demand.add_metric([], queued + held)
        return [demand]


WorkerRow = tuple[str, float, int]
"""(worker, requests it answered, requests it has in flight)."""


class WorkersCollector(Collector):
    """With data-plane workers (`dpserve.router.workers`): how many run, and what each
    answered and holds, so a worker that takes no connections (or all of them) shows."""

    def __init__(self, rows: Callable[[], list[WorkerRow]]) -> None:
        self._rows = rows

    def collect(self) -> Iterable[Metric]:
        rows = self._rows()
        workers = GaugeMetricFamily("dpserve_workers",
                                    "Router processes serving the data plane (leader included).")
        workers.add_metric([], len(rows))
        answered = CounterMetricFamily(
            "dpserve_worker_requests", "Requests each router worker answered (0: the leader).",
            labels=["worker"])
        in_flight = GaugeMetricFamily(
            "dpserve_worker_in_flight_requests",
            "Requests in flight on a replica, by the router worker holding them.",
            labels=["worker"])
        for worker, served, held in rows:
            answered.add_metric([worker], served)
            in_flight.add_metric([worker], held)
        return [workers, answered, in_flight]
