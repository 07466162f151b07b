"""The aiohttp load client, run in a process of its own.

It shares no event loop (and, when pinned, no core) with what it measures. The
parent sends it ``(Case, urls)`` over a pipe; it answers ``"warm"`` once the
unrecorded warm-up is over (so the parent can start its CPU meters), then the
``LoadResult``. Closed loop: each of ``concurrency`` workers sends its next
request when the previous one is read to the end. A response counts only with
status 200 and a complete body (a stream must end with ``data: [DONE]``);
failures are counted and sampled, never timed.

Streams are read with ``iter_any`` (whatever bytes have arrived), so the client
sees chunk boundaries as the network delivers them: with ``Case.events`` it
records, per SSE event (``...\\n\\n``), when it arrived, in which read, and — when
the upstream stamped it with its ``time.monotonic_ns()`` (``fixed_upstream.py
--stamp``; one clock for every process on a Linux machine) — how long it took
from the upstream's write to here. A router that holds chunks back (buffering,
Nagle) shows up in that delivery time and in events that share a read.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, NamedTuple

import aiohttp

DONE_EVENT = b"data: [DONE]\n\n"
EVENT_END = b"\n\n"
SENT_KEY = b'"sent_ns":'
REPLICA_HEADER = "x-dpserve-replica"
REQUEST_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Case:
    """One measured case: a fixed request count or a fixed time."""

    label: str
    stream: bool
    concurrency: int
    body: bytes
    requests: int = 0
    """When > 0, send exactly this many recorded requests after ``warmup_requests``."""
    duration_s: float = 0.0
    """When > 0, keep sending for this long after ``warmup_s``."""
    warmup_requests: int = 0
    warmup_s: float = 0.0
    events: bool = False
    """Record each SSE event's arrival time and read number (streams only)."""
    max_s: float = 120.0
    """Hard limit on each of the warm-up and the recorded phase, whatever the count."""


@dataclass(kw_only=True)
class LoadResult:
    """Raw samples of the recorded phase of one case (times in ns from the request's send)."""

    latencies_ns: list[int] = field(default_factory=list)
    first_byte_ns: list[int] = field(default_factory=list)
    events: list[list[tuple[int, int, int]]] = field(default_factory=list)
    """Per request (with ``Case.events``), per SSE event in order: (ns from the send to
    the read that completed it, number of that read, ns from the upstream's ``sent_ns``
    stamp to that read or -1 without a stamp)."""
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)
    replicas: dict[str, int] = field(default_factory=dict)
    elapsed_ns: int = 0


class _Outcome(NamedTuple):
    total_ns: int
    first_byte_ns: int
    events: list[tuple[int, int, int]]
    replica: str | None
    error: str | None


def _sent_ns(event: bytes) -> int:
    """The ``"sent_ns"`` stamp a paced upstream put in ``event``; -1 when there is none."""
    at = event.find(SENT_KEY)
    if at < 0:
        return -1
    digits = event[at + len(SENT_KEY):at + len(SENT_KEY) + 24].split(b",", 1)[0]
    return int(digits) if digits.isdigit() else -1


async def _send(
    session: aiohttp.ClientSession, url: str, body: bytes, stream: bool, events: bool
) -> _Outcome:
    start = time.perf_counter_ns()
    first = 0
    timeline: list[tuple[int, int, int]] = []
    try:
        async with session.post(
            url, data=body, headers={"Content-Type": "application/json"}
        ) as response:
            replica = response.headers.get(REPLICA_HEADER)
            if stream:
                pending = tail = b""
                reads = 0
                async for chunk in response.content.iter_any():
                    now = time.perf_counter_ns()
                    if not first:
                        first = now
                    tail = (tail + chunk)[-len(DONE_EVENT):]
                    if events:
                        reads += 1
                        *complete_events, pending = (pending + chunk).split(EVENT_END)
                        delivered_at = time.monotonic_ns()
                        for event in complete_events:
                            sent = _sent_ns(event)
                            delivery = delivered_at - sent if sent >= 0 else -1
                            timeline.append((now - start, reads, delivery))
                complete = tail == DONE_EVENT
            else:
                payload = await response.read()
                complete = b'"choices"' in payload
            end = time.perf_counter_ns()
            status = response.status
    except (TimeoutError, aiohttp.ClientError) as exc:
        return _Outcome(0, 0, [], None, f"{type(exc).__name__}: {exc}")
    if status != 200:
        return _Outcome(0, 0, [], replica, f"HTTP {status}")
    if not complete:
        return _Outcome(0, 0, [], replica, "incomplete body")
    return _Outcome(end - start, (first - start) if first else 0, timeline, replica, None)


async def _drive(
    session: aiohttp.ClientSession, case: Case, urls: Sequence[str], *, count: int,
    seconds: float, result: LoadResult | None,
) -> None:
    """Run ``case.concurrency`` closed-loop workers for ``count`` requests or ``seconds``.

    Either way no longer than ``case.max_s`` (plus one request's timeout). Requests go
    round-robin over ``urls``; ``result`` is None during warm-up.
    """
    ticket = itertools.count()
    replicas: Counter[str] = Counter()
    now = time.perf_counter_ns()
    deadline = now + int((min(seconds, case.max_s) if not count else case.max_s) * 1e9)

    async def worker() -> None:
        while True:
            i = next(ticket)
            if (count and i >= count) or time.perf_counter_ns() >= deadline:
                return
            outcome = await _send(session, urls[i % len(urls)], case.body, case.stream,
                                  case.events)
            if result is None:
                continue
            if outcome.error is not None:
                result.errors += 1
                if len(result.error_samples) < 3:
                    result.error_samples.append(outcome.error)
                continue
            result.latencies_ns.append(outcome.total_ns)
            if case.stream:
                result.first_byte_ns.append(outcome.first_byte_ns)
            if case.events:
                result.events.append(outcome.events)
            replicas[outcome.replica or "(no header)"] += 1

    start = time.perf_counter_ns()
    await asyncio.gather(*(worker() for _ in range(case.concurrency)))
    if result is not None:
        result.elapsed_ns = time.perf_counter_ns() - start
        result.replicas = dict(replicas)


async def run_load(case: Case, urls: Sequence[str], on_warm: Callable[[], None]) -> LoadResult:
    """Warm up, call ``on_warm``, then run and record ``case`` against ``urls``."""
    connector = aiohttp.TCPConnector(limit=case.concurrency, limit_per_host=0)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    result = LoadResult()
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await _drive(session, case, urls, count=case.warmup_requests, seconds=case.warmup_s,
                     result=None)
        on_warm()
        await _drive(session, case, urls, count=case.requests, seconds=case.duration_s,
                     result=result)
    return result


def client_main(conn: Connection, cpus: frozenset[int]) -> None:
    """Client process: run each ``(Case, urls)`` received on ``conn``; ``None`` ends it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when to stop
    if cpus:
        os.sched_setaffinity(0, cpus)
    try:
        import uvloop

        runner: Callable[..., Any] = uvloop.run
    except ImportError:
        runner = asyncio.run
    while (job := conn.recv()) is not None:
        case, urls = job
        conn.send(runner(run_load(case, urls, lambda: conn.send("warm"))))
