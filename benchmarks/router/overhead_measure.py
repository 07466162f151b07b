"""Running the cases against one target (direct, dpserve or vllm-router) and summarizing them.

``Bench.run_target`` starts the target's router (if any) on the fast upstreams,
checks one reply of each kind, runs every case, profiles when asked, stops the
router, then starts a second instance in front of the paced upstream for the
pacing case. Numbers come back as plain dataclasses (JSON-ready).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from benchmarks.common.services import (
    CpuMeter,
    Placement,
    Service,
    http_call,
    start_service,
    wait_until_ok,
)
from benchmarks.common.tools import REPO
from benchmarks.router.load_client import DONE_EVENT, REQUEST_TIMEOUT_S, Case, LoadResult
from benchmarks.router.pyspy import (
    as_json,
    py_spy_argv,
    render,
    summarize_speedscope,
    write_collapsed,
)
from benchmarks.router.upstreams import request_body, request_path
from benchmarks.router.wrk import run_wrk, write_script

WARMUP_S = 1.0
PACED_WARMUP_REQUESTS = 2


@dataclass(kw_only=True)
class Env:
    """The tools this run uses (None: absent, a fallback is used) and where processes run."""

    placement: Placement
    nginx: str | None = None
    wrk: str | None = None
    vllm_router: str | None = None
    py_spy: str | None = None
    versions: dict[str, str] = field(default_factory=dict)
    load_before: float | None = None
    """1-minute load average when the run started: other work on the machine skews it."""


@dataclass(frozen=True, kw_only=True)
class Router:
    """A router process under test, where it listens and the path that says it is ready."""

    service: Service
    url: str
    ready_path: str


StartRouter = Callable[[str, Sequence[str]], Router | None]
"""(target name, upstream URLs) -> the started router, or None for ``direct``."""


@dataclass(frozen=True, kw_only=True)
class Stats:
    """One case on one target; times in ms."""

    tool: str
    completed: int
    errors: int
    error_samples: list[str]
    elapsed_s: float
    req_per_s: float
    p50_ms: float | None
    p99_ms: float | None
    first_byte_p50_ms: float | None = None
    first_byte_p99_ms: float | None = None
    router_cpu_us_per_req: float | None = None
    """User+system CPU of the router process per completed request."""


@dataclass(frozen=True, kw_only=True)
class Pacing:
    """How the SSE events of a paced stream reached the client, at c=1; times in ms."""

    completed: int
    errors: int
    error_samples: list[str]
    first_delivery_p50_ms: float | None
    """From the upstream writing the first event to the client reading it."""
    delivery_p50_ms: float | None
    """The same for every later data event ([DONE] carries no stamp)."""
    delivery_p99_ms: float | None
    gap_p50_ms: float | None
    """Between the arrivals of two consecutive events."""
    gap_p99_ms: float | None
    coalesced_ratio: float | None
    """Events that arrived in the same read as the event before them."""


@dataclass(kw_only=True)
class TargetResult:
    name: str
    argv: list[str] = field(default_factory=list)
    ready_s: float | None = None
    cases: dict[str, Stats] = field(default_factory=dict)
    """Keys: ``c1`` (wrk or aiohttp), ``c1_aiohttp`` (cross-check when wrk ran c1),
    ``cN``, ``stream_c1``, ``stream_cN``."""
    paced: Pacing | None = None
    profile: dict[str, Any] | None = None
    rounds: int = 1
    """How many rounds the numbers are the median of (``--rounds``)."""


def percentile_ms(values_ns: Sequence[int], q: float) -> float | None:
    """The ``q``-th percentile (linear interpolation) of ``values_ns`` in ms; None if empty."""
    if not values_ns:
        return None
    try:
        import numpy as np
    except ImportError:
        import statistics

        if len(values_ns) == 1:
            return values_ns[0] / 1e6
        cuts = statistics.quantiles(values_ns, n=1000, method="inclusive")
        return cuts[min(998, max(0, round(q * 10) - 1))] / 1e6
    return float(np.percentile(values_ns, q)) / 1e6


class Bench:
    def __init__(
        self, *, args: argparse.Namespace, env: Env, conn: Connection, work_dir: Path,
        services: list[Service], start_router: StartRouter,
    ) -> None:
        self.args = args
        self.env = env
        self._conn = conn
        self._work_dir = work_dir
        self._services = services
        self._start_router = start_router
        self._scripts = {s: write_script(work_dir / f"post-{'stream' if s else 'json'}.lua",
                                         request_body(s)) for s in (False, True)}
        self.profile_text: str | None = None

    # -- one target --------------------------------------------------------------

    def run_target(
        self, name: str, upstreams: Sequence[str], paced: str | None, *, profile: bool = False
    ) -> TargetResult:
        """Every case against ``name``; with ``profile``, py-spy the dpserve router too."""
        args = self.args
        result = TargetResult(name=name)
        router = self._start_router(name, upstreams)
        try:
            if router is not None:
                result.argv = router.service.argv
                result.ready_s = wait_until_ok(router.service, router.url + router.ready_path)
            bases = [router.url] if router else list(upstreams)
            self._verify(name, bases[0])
            meter = CpuMeter([router.service.pid]) if router else None
            c, cases = args.concurrency, result.cases
            cases["c1"] = self._load(router, meter, bases, stream=False, concurrency=1)
            if cases["c1"].tool == "wrk":
                cases["c1_aiohttp"] = self._load(router, meter, bases, stream=False,
                                                 concurrency=1, tool="aiohttp")
            cases["cN"] = self._load(router, meter, bases, stream=False, concurrency=c)
            if not args.no_stream:
                cases["stream_c1"] = self._load(router, meter, bases, stream=True, concurrency=1,
                                                tool="aiohttp")
                cases["stream_cN"] = self._load(router, meter, bases, stream=True, concurrency=c)
            if name == "dpserve" and profile and self.env.py_spy and router:
                result.profile = self._profile(router, bases)
        finally:
            if router is not None:
                self._stop(router)
        if paced is not None:
            result.paced = self._paced(name, paced)
        return result

    def _stop(self, router: Router) -> None:
        router.service.stop()
        if router.service in self._services:
            self._services.remove(router.service)

    def _verify(self, name: str, base: str) -> None:
        """One request of each kind must succeed with the full body before any load."""
        kinds = [False] if self.args.no_stream else [False, True]
        for stream in kinds:
            status, body = http_call(base + request_path(stream), request_body(stream), 10.0)
            ok = body.endswith(DONE_EVENT) if stream else b'"choices"' in body
            if status != 200 or not ok:
                raise RuntimeError(f"{name}: {base + request_path(stream)} answered {status} "
                                   f"with {body[:300]!r}; expected a complete reply")

    # -- loads -------------------------------------------------------------------

    def _load(
        self, router: Router | None, meter: CpuMeter | None, bases: Sequence[str], *,
        stream: bool, concurrency: int, tool: str | None = None, duration_s: float | None = None,
    ) -> Stats:
        """One case with wrk (when available and it can time the case) or the aiohttp client."""
        args = self.args
        duration = duration_s or args.duration
        use_wrk = self.env.wrk is not None and tool != "aiohttp" and (concurrency > 1 or not stream)
        label = f"{'stream' if stream else 'completions'} c={concurrency}"
        if use_wrk:
            assert self.env.wrk is not None
            url = bases[0] + request_path(stream)
            script = self._scripts[stream]
            run_wrk(self.env.wrk, url, script, connections=concurrency,
                    threads=len(self.env.placement.load) or 1, duration_s=WARMUP_S)
            before = meter.seconds() if meter else None
            w = run_wrk(self.env.wrk, url, script, connections=concurrency,
                        threads=len(self.env.placement.load) or 1, duration_s=duration)
            cpu = _cpu_us(meter, before, w.requests - w.errors)
            stats = Stats(tool="wrk", completed=w.requests, errors=w.errors, error_samples=[],
                          elapsed_s=w.elapsed_s, req_per_s=w.req_per_s, p50_ms=w.p50_ms,
                          p99_ms=w.p99_ms, router_cpu_us_per_req=cpu)
        else:
            urls = [b + request_path(stream) for b in bases]
            if concurrency == 1:
                n = max(1, args.requests // 4) if stream else args.requests
                case = Case(label, stream, 1, request_body(stream), requests=n,
                            warmup_requests=args.warmup)
                urls = urls[:1]
            else:
                case = Case(label, stream, concurrency, request_body(stream), duration_s=duration,
                            warmup_s=WARMUP_S)
            result, cpu = self._client(case, urls, meter)
            stats = _summarize(result, cpu)
        if router is not None:
            router.service.check_alive(label)
        return stats

    def _client(
        self, case: Case, urls: Sequence[str], meter: CpuMeter | None
    ) -> tuple[LoadResult, float | None]:
        """Run ``case`` in the client process; meter the router over the recorded part."""
        self._conn.send((case, list(urls)))
        # Each phase ends within max_s plus one request's timeout; wait a little longer.
        limit = case.max_s + REQUEST_TIMEOUT_S + 30
        if self._receive(limit, case) != "warm":
            raise RuntimeError("load client protocol error: expected the warm-up marker")
        before = meter.seconds() if meter else None
        result: LoadResult = self._receive(limit, case)
        done = len(result.latencies_ns)
        return result, _cpu_us(meter, before, done)

    def _receive(self, timeout_s: float, case: Case) -> Any:
        if not self._conn.poll(timeout_s):
            raise RuntimeError(f"the load client sent nothing for {timeout_s:.0f} s "
                               f"during '{case.label}'")
        return self._conn.recv()

    def _paced(self, name: str, paced: str) -> Pacing:
        router = self._start_router(name, [paced])
        try:
            if router is not None:
                wait_until_ok(router.service, router.url + router.ready_path)
            base = router.url if router else paced
            case = Case("paced stream", True, 1, request_body(True),
                        requests=self.args.paced_requests,
                        warmup_requests=PACED_WARMUP_REQUESTS, events=True)
            result, _ = self._client(case, [base + request_path(True)], None)
            if router is not None:
                router.service.check_alive("the paced stream case")
        finally:
            if router is not None:
                self._stop(router)
        return summarize_pacing(result, self.args.chunks + 1)

    # -- profile -----------------------------------------------------------------

    def _profile(self, router: Router, bases: Sequence[str]) -> dict[str, Any] | None:
        """A c=C run with py-spy attached to the router; None (and a note) if py-spy fails."""
        assert self.env.py_spy is not None
        args = self.args
        out_dir = args.profile_dir or REPO / "runs" / time.strftime("profile-%Y%m%d-%H%M%S")
        out_dir.mkdir(parents=True, exist_ok=True)
        out = out_dir / "dpserve-router.speedscope.json"
        argv = py_spy_argv(self.env.py_spy, router.service.pid, out, args.duration,
                           args.profile_rate)
        spy = start_service("py-spy", argv, self._work_dir, cpus=self.env.placement.load)
        self._services.append(spy)
        try:
            time.sleep(0.5)  # py-spy attaches; the load below outlasts its window
            stats = self._load(router, None, bases, stream=False,
                               concurrency=args.concurrency, duration_s=args.duration + 2)
            try:
                code: int | None = spy.proc.wait(30)
            except subprocess.TimeoutExpired:
                code = None
            if code != 0 or not out.exists():
                print(f"note: py-spy failed (code {code}); no profile. Its output:\n"
                      f"{spy.log_tail()}\n(py-spy needs ptrace: run as root, or set "
                      "kernel.yama.ptrace_scope=0)")
                return None
        finally:
            spy.stop()
            self._services.remove(spy)
        summary = summarize_speedscope(out)
        collapsed = out.with_name("dpserve-router.collapsed.txt")
        write_collapsed(out, collapsed)
        self.profile_text = render(summary)
        return {"speedscope": str(out), "collapsed": str(collapsed),
                "req_per_s_under_profiler": stats.req_per_s, **as_json(summary)}


def merge_rounds(rounds: Sequence[TargetResult]) -> TargetResult:
    """One target's rounds as one result: the median of every number, counts summed.

    A percentile becomes the median of the rounds' percentiles, which is what
    interleaved rounds are for: a burst of other work on the machine spoils one
    round, not the result.
    """
    first = rounds[0]
    cases = {key: _merge([r.cases[key] for r in rounds if key in r.cases])
             for key in first.cases}
    paced = [r.paced for r in rounds if r.paced is not None]
    ready = [r.ready_s for r in rounds if r.ready_s is not None]
    return TargetResult(
        name=first.name, argv=first.argv, ready_s=statistics.median(ready) if ready else None,
        cases=cases, paced=_merge(paced) if paced else None,
        profile=next((r.profile for r in rounds if r.profile), None), rounds=len(rounds),
    )


def _merge(items: Sequence[Any]) -> Any:
    """Field by field over same-type dataclasses: counts summed, numbers' median, else first."""
    merged: dict[str, Any] = {}
    for f in fields(items[0]):
        values = [getattr(item, f.name) for item in items]
        numbers = [v for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
        if f.name in ("completed", "errors"):
            merged[f.name] = sum(values)
        elif f.name == "error_samples":
            merged[f.name] = [e for v in values for e in v][:3]
        elif numbers:  # None in a round where it could not be measured: left out
            merged[f.name] = statistics.median(numbers)
        else:
            merged[f.name] = values[0]
    return replace(items[0], **merged)


def _cpu_us(meter: CpuMeter | None, before: float | None, done: int) -> float | None:
    if meter is None or before is None or done <= 0:
        return None
    after = meter.seconds()
    return None if after is None else (after - before) / done * 1e6


def _summarize(result: LoadResult, router_cpu_us: float | None) -> Stats:
    done = len(result.latencies_ns)
    elapsed = result.elapsed_ns / 1e9
    fb = result.first_byte_ns
    return Stats(
        tool="aiohttp", completed=done, errors=result.errors,
        error_samples=result.error_samples, elapsed_s=elapsed,
        req_per_s=done / elapsed if elapsed else 0.0,
        p50_ms=percentile_ms(result.latencies_ns, 50),
        p99_ms=percentile_ms(result.latencies_ns, 99),
        first_byte_p50_ms=percentile_ms(fb, 50), first_byte_p99_ms=percentile_ms(fb, 99),
        router_cpu_us_per_req=router_cpu_us,
    )


def summarize_pacing(result: LoadResult, events: int) -> Pacing:
    """Delivery times, gaps and coalescing over the streams that brought every event."""
    rows = [r for r in result.events if len(r) == events]
    short = len(result.events) - len(rows)
    first = [r[0][2] for r in rows if r[0][2] >= 0]
    later = [e[2] for r in rows for e in r[1:] if e[2] >= 0]
    gaps = [r[i][0] - r[i - 1][0] for r in rows for i in range(1, events)]
    same_read = sum(r[i][1] == r[i - 1][1] for r in rows for i in range(1, events))
    pairs = len(rows) * (events - 1)
    samples = list(result.error_samples)
    if short:
        samples.append(f"{short} streams without exactly {events} events")
    return Pacing(
        completed=len(rows), errors=result.errors + short, error_samples=samples[:3],
        first_delivery_p50_ms=percentile_ms(first, 50),
        delivery_p50_ms=percentile_ms(later, 50), delivery_p99_ms=percentile_ms(later, 99),
        gap_p50_ms=percentile_ms(gaps, 50), gap_p99_ms=percentile_ms(gaps, 99),
        coalesced_ratio=same_read / pairs if pairs else None,
    )
