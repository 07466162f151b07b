"""When each replica last sent a stream a chunk: kept only while a stream is
registered there (one waiting for its first chunk asks), so the record never grows
with the replicas that came and went."""

from __future__ import annotations

from typing import Any, cast

from dpserve.router.fleet.live import LiveStreams
from dpserve.router.upstream.connection import UpstreamResponse


def response() -> UpstreamResponse:
    return cast(UpstreamResponse, object())


def test_a_replica_is_heard_only_while_a_stream_there_can_ask():
    live = LiveStreams()
    live.heard("r0")  # no stream registered on r0: nobody waits there
    assert live.last_heard("r0") == 0.0
    resp: Any = response()
    with live.running("r0", resp, lambda: True, restarts=True):
        live.heard("r0")
        assert live.last_heard("r0") > 0.0
    assert live.last_heard("r0") == 0.0 and live.replicas() == []


def test_replicas_that_come_and_go_leave_nothing_behind():
    live = LiveStreams()
    for i in range(1000):
        with live.running(f"r{i}", response(), lambda: True):
            live.heard(f"r{i}")
    assert [live.last_heard(f"r{i}") for i in range(1000)] == [0.0] * 1000
