"""`/metrics` for the peer channel, read at scrape time. Labels are fixed words only."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dpserve.router.peers.channel import ChannelStats
from dpserve.router.peers.state import PeerState

REJECT_REASONS = ("size", "mac", "format")


class _Link(Protocol):
    state: PeerState

    @property
    def channel_stats(self) -> ChannelStats: ...


class PeerCollector(Collector):
    def __init__(self, link: _Link) -> None:
        self._link = link

    def collect(self) -> Iterable[Metric]:
        channel = self._link.channel_stats
        state = self._link.state
        yield GaugeMetricFamily("dpserve_peers_live",
                                "Peer routers heard from within the last 3 s.",
                                value=state.live())
        yield GaugeMetricFamily("dpserve_peer_endpoints",
                                "Addresses the peer names resolve to, connected.",
                                value=len(channel.connected))
        yield CounterMetricFamily("dpserve_peer_reports_sent",
                                  "Reports this router published to its peers.",
                                  value=channel.sent)
        yield CounterMetricFamily("dpserve_peer_reports_received",
                                  "Peers' reports accepted (signed, well formed).",
                                  value=channel.received)
        rejected = CounterMetricFamily(
            "dpserve_peer_reports_rejected",
            "Messages on the peer channel refused: size (too large), mac (not signed with "
            "the peers' key), format (malformed or out of bounds).", labels=["reason"])
        for reason in REJECT_REASONS:
            rejected.add_metric([reason], channel.rejected.get(reason, 0))
        yield rejected
        ignored = CounterMetricFamily(
            "dpserve_peer_reports_ignored",
            "Accepted reports not applied, or applied without their prompts: "
            "out_of_order (older than one applied), foreign_keys (a peer of another build: "
            "its prompts' keys cannot be read).", labels=["reason"])
        ignored.add_metric(["out_of_order"], state.stats.out_of_order)
        ignored.add_metric(["foreign_keys"], state.stats.foreign_keys)
        yield ignored
        yield CounterMetricFamily("dpserve_peer_prompts",
                                  "Prompts peers placed, counted as held where they went "
                                  "until the engine reports them (kv-aware).",
                                  value=state.stats.prompts)
        yield CounterMetricFamily("dpserve_peer_resolve_errors",
                                  "Lookups of a peer name that failed.",
                                  value=channel.resolve_errors)
