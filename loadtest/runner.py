"""The load loop: warm-up, then requests sent on schedule, each under a timeout.

One `aiohttp.ClientSession` carries every request; its connector allows as
many connections as the concurrency cap (unlimited without one), so a request
never waits for a pooled connection behind the cap's back. The loop is bounded
in count (one request per scheduled offset), in time (no request is sent after
``duration_s``; one due exactly then still is) and per request
(``request_timeout_s``), so it always ends; a caller may end it sooner (``stop``).

With a concurrency cap, a request whose time has come waits for a free slot;
its TTFT and latency are timed from when it is actually sent, and the wait is
its queue time (vLLM's benchmark does the same).
"""

from __future__ import annotations

import asyncio
import gc
import math
import sys
import time
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from tqdm import tqdm

from loadtest.client import Payload, RequestRecord, send


@dataclass(frozen=True, kw_only=True)
class LoadPlan:
    url: str
    payloads: Sequence[Payload]
    """Request bodies; request ``i`` sends ``payloads[i % len(payloads)]``."""
    offsets: Sequence[float]
    """Send offsets (seconds from the start), one per request: their number bounds the run."""
    max_concurrency: int | None = None
    duration_s: float | None = None
    request_timeout_s: float = 600.0
    num_warmups: int = 0
    stream: bool = True
    headers: Mapping[str, str] = field(default_factory=dict)
    request_id_prefix: str = "loadtest-"
    progress: bool = False
    label: str = ""
    stop: asyncio.Event | None = None
    """Once set, no further request is sent (those in flight finish): a load that runs
    until its caller is done with it rather than for a set time or count."""
    other_urls: Sequence[str] = ()
    """More URLs of the same service (e.g. two routers in front of one fleet): requests
    go to ``url`` and these in turn, see `url_for`."""

    def url_for(self, i: int) -> str:
        """Request ``i``'s URL: ``url``, then each of ``other_urls``, then ``url`` again, as
        clients behind a Kubernetes Service reach its pods in turn."""
        urls = (self.url, *self.other_urls)
        return urls[i % len(urls)]


@dataclass(frozen=True, kw_only=True)
class RunOutcome:
    records: list[RequestRecord]
    duration_s: float
    """From the start of the run to the end of its last request."""
    started_perf_s: float
    """``time.perf_counter()`` at the start: add a record's offsets for absolute times."""


async def run_load(plan: LoadPlan) -> RunOutcome:
    connector = aiohttp.TCPConnector(limit=plan.max_concurrency or 0,
                                     limit_per_host=plan.max_concurrency or 0,
                                     keepalive_timeout=60)
    timeout = aiohttp.ClientTimeout(total=plan.request_timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        if plan.num_warmups:
            await _warm_up(session, plan)
        # Everything allocated so far lives for the whole run: keep the
        # collector from walking it between requests.
        gc.collect()
        gc.freeze()
        try:
            return await _dispatch(session, plan)
        finally:
            gc.unfreeze()


async def _dispatch(session: aiohttp.ClientSession, plan: LoadPlan) -> RunOutcome:
    slots = asyncio.Semaphore(plan.max_concurrency) if plan.max_concurrency else None
    in_flight: set[asyncio.Task[None]] = set()
    records: list[RequestRecord] = []
    total = None if plan.duration_s else len(plan.offsets)
    headers = dict(plan.headers)

    def stopped() -> bool:
        return plan.stop is not None and plan.stop.is_set()

    with _progress(plan, total) as bar:
        t0 = time.perf_counter()
        deadline = t0 + (plan.duration_s or math.inf)

        async def one(payload: Payload, record: RequestRecord) -> None:
            try:
                await send(session, plan.url_for(record.index), payload, record, t0=t0,
                           stream=plan.stream, headers=headers)
            finally:
                if slots is not None:
                    slots.release()
                if bar is not None:
                    bar.update(1)

        try:
            for i, due in enumerate(plan.offsets):
                if t0 + due > deadline:
                    break
                wait = t0 + due - time.perf_counter()
                if wait > 0:
                    await asyncio.sleep(wait)
                if stopped():
                    break
                if slots is not None:
                    await slots.acquire()
                    if time.perf_counter() > deadline or stopped():
                        slots.release()
                        break
                record = RequestRecord(index=i, request_id=f"{plan.request_id_prefix}{i}",
                                       scheduled_s=due)
                records.append(record)
                task = asyncio.create_task(one(plan.payloads[i % len(plan.payloads)], record))
                in_flight.add(task)
                task.add_done_callback(in_flight.discard)
            # Every request ends by its own timeout, so this wait is bounded.
            await asyncio.gather(*in_flight)
        except BaseException:
            for task in in_flight:
                task.cancel()
            await asyncio.gather(*in_flight, return_exceptions=True)
            raise
        duration = time.perf_counter() - t0
    return RunOutcome(records=records, duration_s=duration, started_perf_s=t0)


async def _warm_up(session: aiohttp.ClientSession, plan: LoadPlan) -> None:
    """Send ``num_warmups`` requests, as many at once as the cap allows; not recorded."""
    slots = asyncio.Semaphore(plan.max_concurrency or plan.num_warmups)
    t0 = time.perf_counter()

    async def one(i: int) -> None:
        async with slots:
            record = RequestRecord(index=i, request_id=f"{plan.request_id_prefix}warmup-{i}",
                                   scheduled_s=0.0)
            await send(session, plan.url_for(i), plan.payloads[i % len(plan.payloads)],
                       record, t0=t0, stream=plan.stream, headers=dict(plan.headers))

    await asyncio.gather(*(one(i) for i in range(plan.num_warmups)))


def _progress(plan: LoadPlan, total: int | None
              ) -> AbstractContextManager[tqdm[Any] | None]:
    if not plan.progress:
        return nullcontext()
    return tqdm(total=total, desc=plan.label or "requests", unit="req", file=sys.stderr,
                dynamic_ncols=True, leave=False)
