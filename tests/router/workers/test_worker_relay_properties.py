"""Property-based tests of the hop a follower worker relays requests on
(`dpserve.router.workers`): a request a follower does not forward itself (probes,
`/metrics`, `/admin/*`, a wrong method) is answered by the leader's app, over a socket
pair.

Whatever bytes the front let through (header names and values, query, body) of a
request the leader is to answer (here `/admin/*`, the only requests whose body a
follower relays; it refuses unknown paths itself) must reach the leader's app exactly
as the client sent them: the leader checks auth and admin access on them, so a byte
changed on the way is a check made on other input.
And the leader's answer must reach the client exactly, framed by the follower's own
front with one Content-Length, never the leader's framing headers.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dpserve.router.workers.follower import follower_app
from tests.router.workers.test_worker_sync import leader_and_follower

SETTINGS = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])

header_names = st.binary(min_size=1, max_size=40)
headers = st.lists(st.tuples(header_names, st.binary(max_size=200)), max_size=12)
paths = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=60).map(
    lambda tail: "/admin/relayed/" + tail)
methods = st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"])
bodies = st.binary(max_size=4096)


class Recorder:
    """The leader's app: remembers what it was asked and answers as told (`reply`)."""

    def __init__(self) -> None:
        self.reply: tuple[int, list[tuple[bytes, bytes]], list[bytes]] = (200, [], [])
        self.seen: list[tuple[dict[str, Any], bytes]] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        body = b""
        while True:
            event = await receive()
            body += event.get("body", b"")
            if not event.get("more_body", False):
                break
        self.seen.append((scope, body))
        status, headers, parts = self.reply
        await send({"type": "http.response.start", "status": status, "headers": headers})
        for i, part in enumerate(parts):
            await send({"type": "http.response.body", "body": part,
                        "more_body": i < len(parts) - 1})


@dataclass
class Hop:
    """A leader and a follower over a real socket pair, on an event loop of their own
    (one for every example: setting them up costs more than an example)."""

    loop: asyncio.AbstractEventLoop
    recorder: Recorder
    app: Any

    def run(self, scope: dict[str, Any], body: bytes, body_parts: int
            ) -> list[dict[str, Any]]:
        """One request through the follower's app; what its client was sent."""
        return asyncio.run_coroutine_threadsafe(
            self._one(scope, body, body_parts), self.loop).result(timeout=30)

    async def _one(self, scope: dict[str, Any], body: bytes, body_parts: int
                   ) -> list[dict[str, Any]]:
        sent: list[dict[str, Any]] = []
        # Contiguous pieces, as a server hands over a body it read in several reads.
        size = -(-len(body) // body_parts) if body else 1
        pieces = [body[i:i + size] for i in range(0, len(body), size)] or [b""]
        events = [{"type": "http.request", "body": p, "more_body": i < len(pieces) - 1}
                  for i, p in enumerate(pieces)]

        async def receive() -> dict[str, Any]:
            if events:
                return events.pop(0)
            await asyncio.Event().wait()
            raise AssertionError("unreachable")

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        await self.app(scope, receive, send)
        return sent


@pytest.fixture(scope="module")
def hop() -> Iterator[Hop]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    recorder = Recorder()
    ready: concurrent.futures.Future[Any] = concurrent.futures.Future()
    done = asyncio.Event()

    async def hold() -> None:
        async with leader_and_follower(leader_app=recorder) as (_, _, follow, follower):
            ready.set_result(follower_app(follow, follower))
            await done.wait()

    holding = asyncio.run_coroutine_threadsafe(hold(), loop)
    try:
        yield Hop(loop, recorder, ready.result(timeout=30))
    finally:
        loop.call_soon_threadsafe(done.set)
        holding.result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


@SETTINGS
@given(method=methods, path=paths, query=st.binary(max_size=100), header_list=headers,
       body=bodies, body_parts=st.integers(1, 4), status=st.integers(200, 599),
       reply_headers=headers, reply_parts=st.lists(st.binary(max_size=2048), max_size=4))
def test_a_relayed_request_and_its_answer_cross_the_hop_unchanged(
        hop, method, path, query, header_list, body, body_parts, status, reply_headers,
        reply_parts):
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": method, "scheme": "http", "path": path,
             "raw_path": path.encode(), "query_string": query, "root_path": "",
             "headers": header_list, "client": ("127.0.0.1", 51234),
             "server": ("127.0.0.1", 8000)}
    hop.recorder.seen.clear()
    hop.recorder.reply = (status, reply_headers, reply_parts)
    sent = hop.run(scope, body, body_parts)

    ((seen, seen_body),) = hop.recorder.seen
    assert (seen["method"], seen["path"], seen["query_string"]) == (method, path, query)
    assert seen["headers"] == header_list  # every byte, in order, duplicates kept
    assert seen["client"] == ("127.0.0.1", 51234) and seen["server"] == ("127.0.0.1", 8000)
    assert seen_body == body

    start, *body_events = sent
    assert start["status"] == status
    framing = (b"content-length", b"transfer-encoding")
    expected = [(n, v) for n, v in reply_headers if n.lower() not in framing]
    whole = b"".join(reply_parts)
    assert start["headers"] == [*expected, (b"content-length", str(len(whole)).encode())]
    assert b"".join(e.get("body", b"") for e in body_events) == whole
    assert not body_events[-1].get("more_body", False)
