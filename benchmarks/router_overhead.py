"""What the dpserve router costs on top of talking to a replica directly.

Measured in one run, side by side, against fixed-response fake upstreams
(``benchmarks/fixed_upstream.py``, which do no inference) so that any
difference is the router's own cost:

1. **Added latency at concurrency 1** — ``POST /v1/completions``, non-streaming,
   small JSON body: p50 and p99 sent straight to one upstream vs through the
   router, and the difference (router - direct) in ms. The p50 difference is
   compared with the target of at most 1 ms.
2. **Throughput at concurrency C** (default 32) for a fixed time — req/s sent
   straight to the upstreams (round-robin) vs through the router, and the ratio.
3. **Streaming** (unless ``--no-stream``) — the same two cases with
   ``"stream": true``; each upstream reply is ``--chunks`` SSE events plus
   ``data: [DONE]``. Latency is time to the last byte; time to the first byte is
   reported too.

How: the upstreams and the router (started through its CLI,
``python -m dpserve router --replica URL ...``) each run in their own process
group, bound to 127.0.0.1 on free ports. The load client is an aiohttp
``ClientSession`` (keep-alive, a ``TCPConnector`` sized to the concurrency) in a
separate process, so it shares no event loop with what it measures. Every case
starts with an unrecorded warm-up. Latency is ``time.perf_counter_ns`` around
send-to-body-read in the client. Server CPU per request (``psutil``, when
importable) sums the user+system time of the upstreams, plus the router on the
router side, so router - direct is the router's CPU per request.

On a small machine the client, the router and the upstreams compete for the
same cores; the throughput ratio then measures that contention as much as the
router, and the script says so in its output.

    python benchmarks/router_overhead.py [--requests 2000] [--concurrency 32]
        [--duration 5] [--upstreams 2] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import multiprocessing
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import IO, Any, NamedTuple

import aiohttp

HOST = "127.0.0.1"
MODEL = "fixed-model"
TARGET_ADDED_P50_MS = 1.0
STARTUP_TIMEOUT_S = 60.0
POLL_INTERVAL_S = 0.1
STOP_GRACE_S = 5.0
REQUEST_TIMEOUT_S = 30.0
THROUGHPUT_WARMUP_S = 1.0
DONE_EVENT = b"data: [DONE]\n\n"
REPLICA_HEADER = "x-dpserve-replica"
FIXED_UPSTREAM = Path(__file__).resolve().with_name("fixed_upstream.py")
DEFAULT_ROUTER_CMD = "{python} -m dpserve router {replica_flags} --host 127.0.0.1 --port {port}"


# --------------------------------------------------------------------------
# Load client (runs in its own process)
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One measured case: a fixed request count (latency) or a fixed time (throughput)."""

    label: str
    stream: bool
    concurrency: int
    requests: int = 0
    """When > 0, send exactly this many recorded requests after ``warmup_requests``."""
    duration_s: float = 0.0
    """When > 0, keep sending for this long after ``warmup_s``."""
    warmup_requests: int = 0
    warmup_s: float = 0.0


@dataclass(kw_only=True)
class LoadResult:
    """Raw samples of the recorded phase of one case."""

    latencies_ns: list[int] = field(default_factory=list)
    first_byte_ns: list[int] = field(default_factory=list)
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)
    replicas: dict[str, int] = field(default_factory=dict)
    elapsed_ns: int = 0


class Outcome(NamedTuple):
    total_ns: int
    first_byte_ns: int
    replica: str | None
    error: str | None


def request_body(stream: bool) -> bytes:
    """The small completion request every case sends."""
    body = {"model": MODEL, "prompt": "Say hello", "max_tokens": 16, "temperature": 0.0}
    if stream:
        body["stream"] = True
    return json.dumps(body).encode()


async def _send(session: aiohttp.ClientSession, url: str, body: bytes, stream: bool) -> Outcome:
    start = time.perf_counter_ns()
    first = 0
    try:
        async with session.post(
            url, data=body, headers={"Content-Type": "application/json"}
        ) as response:
            replica = response.headers.get(REPLICA_HEADER)
            if stream:
                tail = b""
                async for chunk in response.content.iter_any():
                    if not first:
                        first = time.perf_counter_ns()
                    tail = (tail + chunk)[-len(DONE_EVENT) :]
                complete = tail == DONE_EVENT
            else:
                payload = await response.read()
                complete = b'"choices"' in payload
            end = time.perf_counter_ns()
            status = response.status
    except (TimeoutError, aiohttp.ClientError) as exc:
        return Outcome(0, 0, None, f"{type(exc).__name__}: {exc}")
    if status != 200:
        return Outcome(0, 0, replica, f"HTTP {status}")
    if not complete:
        return Outcome(0, 0, replica, "incomplete body")
    return Outcome(end - start, (first - start) if first else 0, replica, None)


async def _drive(
    session: aiohttp.ClientSession,
    case: Case,
    urls: Sequence[str],
    *,
    count: int,
    seconds: float,
    result: LoadResult | None,
) -> None:
    """Run ``case.concurrency`` closed-loop workers for ``count`` requests or ``seconds``.

    Requests go round-robin over ``urls``; ``result`` is None during warm-up.
    """
    body = request_body(case.stream)
    ticket = itertools.count()
    replicas: Counter[str] = Counter()
    deadline = time.perf_counter_ns() + int(seconds * 1e9)

    async def worker() -> None:
        while True:
            i = next(ticket)
            if count and i >= count:
                return
            if not count and time.perf_counter_ns() >= deadline:
                return
            outcome = await _send(session, urls[i % len(urls)], body, case.stream)
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
        warm = {"count": case.warmup_requests, "seconds": case.warmup_s}
        await _drive(session, case, urls, **warm, result=None)
        on_warm()
        await _drive(
            session, case, urls, count=case.requests, seconds=case.duration_s, result=result
        )
    return result


def client_main(conn: Connection) -> None:
    """Client process: run each ``(Case, urls)`` received on ``conn``; ``None`` ends it.

    Per case it sends ``"warm"`` when the warm-up is over, then the ``LoadResult``.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when to stop
    try:
        import uvloop

        runner: Callable[..., Any] = uvloop.run
    except ImportError:
        runner = asyncio.run
    while (job := conn.recv()) is not None:
        case, urls = job
        conn.send(runner(run_load(case, urls, lambda: conn.send("warm"))))


# --------------------------------------------------------------------------
# Processes under test
# --------------------------------------------------------------------------


@dataclass(kw_only=True)
class Service:
    """A process we started in its own group, with its output in a temp file."""

    name: str
    proc: subprocess.Popen[bytes]
    log: IO[bytes]

    def log_tail(self, lines: int = 20) -> str:
        self.log.flush()
        text = Path(self.log.name).read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            for sig, wait_s in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, None)):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(wait_s)
                    break
                except subprocess.TimeoutExpired:
                    continue
        self.log.close()


def start_service(name: str, argv: Sequence[str], log_dir: Path) -> Service:
    log = (log_dir / f"{name}.log").open("w+b")
    proc = subprocess.Popen(
        list(argv),
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    return Service(name=name, proc=proc, log=log)


def free_ports(n: int) -> list[int]:
    """Ports the kernel hands out as free, held open together so they differ."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind((HOST, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def http_status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, OSError):
        return None


def wait_until_ok(service: Service, url: str, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
    """Poll ``url`` until it answers 200; fail early if the process has exited."""
    deadline = time.monotonic() + timeout_s
    last: int | None = None
    while time.monotonic() < deadline:
        if service.proc.poll() is not None:
            raise RuntimeError(
                f"{service.name} exited with code {service.proc.returncode} before "
                f"{url} answered 200; its output:\n{service.log_tail()}"
            )
        last = http_status(url)
        if last == 200:
            return
        time.sleep(POLL_INTERVAL_S)
    raise RuntimeError(
        f"{service.name}: {url} did not answer 200 within {timeout_s:.0f} s "
        f"(last status: {last}); its output:\n{service.log_tail()}"
    )


def router_argv(template: str, replicas: Sequence[str], port: int) -> list[str]:
    """The router's command line; adds ``--log-level warning`` when dpserve accepts it."""
    argv = shlex.split(
        template.format(
            python=shlex.quote(sys.executable),
            port=port,
            replicas=" ".join(replicas),
            replica_flags=" ".join(f"--replica {r}" for r in replicas),
        )
    )
    if template == DEFAULT_ROUTER_CMD:
        probe = subprocess.run(
            [sys.executable, "-m", "dpserve", "router", "--help"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        if probe.returncode != 0:
            raise RuntimeError(
                "`python -m dpserve router --help` failed "
                f"(code {probe.returncode}):\n{probe.stderr.strip()[-2000:]}"
            )
        if "--log-level" in probe.stdout:
            argv += ["--log-level", "warning"]
    return argv


class CpuMeter:
    """User+system CPU seconds of a set of processes and their children (psutil)."""

    def __init__(self, pids: Sequence[int]) -> None:
        try:
            import psutil
        except ImportError:
            self._procs: list[Any] | None = None
            return
        self._procs = [psutil.Process(pid) for pid in pids]

    def seconds(self) -> float | None:
        if self._procs is None:
            return None
        total = 0.0
        for proc in self._procs:
            for p in (proc, *proc.children(recursive=True)):
                times = p.cpu_times()
                total += times.user + times.system
        return total


# --------------------------------------------------------------------------
# Cases, statistics, report
# --------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Side:
    """Summary of one case on one side (direct or router); times in ms."""

    completed: int
    errors: int
    error_samples: list[str]
    elapsed_s: float
    req_per_s: float
    p50_ms: float | None
    p99_ms: float | None
    mean_ms: float | None
    first_byte_p50_ms: float | None
    first_byte_p99_ms: float | None
    server_cpu_us_per_req: float | None
    replicas: dict[str, int]


def percentile_ms(values_ns: Sequence[int], q: int) -> float | None:
    """The ``q``-th percentile (linear interpolation) of ``values_ns`` in ms; None if empty."""
    if not values_ns:
        return None
    if len(values_ns) == 1:
        return values_ns[0] / 1e6
    try:
        import numpy as np
    except ImportError:
        import statistics

        return statistics.quantiles(values_ns, n=100, method="inclusive")[q - 1] / 1e6
    return float(np.percentile(values_ns, q)) / 1e6


def summarize(result: LoadResult, cpu_s: float | None) -> Side:
    done = len(result.latencies_ns)
    elapsed = result.elapsed_ns / 1e9
    fb = result.first_byte_ns
    return Side(
        completed=done,
        errors=result.errors,
        error_samples=result.error_samples,
        elapsed_s=elapsed,
        req_per_s=done / elapsed if elapsed else 0.0,
        p50_ms=percentile_ms(result.latencies_ns, 50),
        p99_ms=percentile_ms(result.latencies_ns, 99),
        mean_ms=sum(result.latencies_ns) / done / 1e6 if done else None,
        first_byte_p50_ms=percentile_ms(fb, 50),
        first_byte_p99_ms=percentile_ms(fb, 99),
        server_cpu_us_per_req=cpu_s / done * 1e6 if cpu_s is not None and done else None,
        replicas=result.replicas,
    )


def measure(conn: Connection, case: Case, urls: Sequence[str], cpu: CpuMeter) -> Side:
    """Run one case in the client process; meter server CPU over the recorded part."""
    conn.send((case, list(urls)))
    if conn.recv() != "warm":
        raise RuntimeError("load client protocol error: expected the warm-up marker")
    before = cpu.seconds()
    result: LoadResult = conn.recv()
    after = cpu.seconds()
    cpu_s = after - before if before is not None and after is not None else None
    return summarize(result, cpu_s)


class Row(NamedTuple):
    case: str
    metric: str
    direct: float | None
    router: float | None
    digits: int = 3
    show_difference: bool = True


def _fmt(value: float | None, digits: int, sign: str = "") -> str:
    return "-" if value is None else f"{value:{sign}.{digits}f}"


def render(rows: Sequence[Row]) -> str:
    """The results table: one line per metric, the case named on its first line."""
    header = (
        f"{'case':<24} {'metric':<22} {'direct':>9} {'router':>9} "
        f"{'router-direct':>14} {'router/direct':>14}"
    )
    lines = [header, "-" * len(header)]
    previous = ""
    for row in rows:
        diff = ratio = None
        if row.direct is not None and row.router is not None:
            diff = row.router - row.direct if row.show_difference else None
            ratio = row.router / row.direct if row.direct else None
        case = row.case if row.case != previous else ""
        lines.append(
            f"{case:<24} {row.metric:<22} {_fmt(row.direct, row.digits):>9} "
            f"{_fmt(row.router, row.digits):>9} {_fmt(diff, row.digits, '+'):>14} "
            f"{_fmt(ratio, 2):>14}"
        )
        previous = row.case
    return "\n".join(lines)


def table_rows(results: Sequence[tuple[Case, Side, Side]]) -> list[Row]:
    rows: list[Row] = []
    for case, d, r in results:
        name = case.label
        if case.duration_s:
            rows.append(Row(name, "req/s", d.req_per_s, r.req_per_s, 0, False))
        last = " (last byte)" if case.stream else ""
        rows.append(Row(name, f"p50 ms{last}", d.p50_ms, r.p50_ms))
        rows.append(Row(name, f"p99 ms{last}", d.p99_ms, r.p99_ms))
        if case.stream:
            rows.append(Row(name, "p50 ms (first byte)", d.first_byte_p50_ms, r.first_byte_p50_ms))
        cpu = (d.server_cpu_us_per_req, r.server_cpu_us_per_req)
        rows.append(Row(name, "server CPU us/req", *cpu, digits=0))
    return rows


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="dpserve router overhead vs direct upstream calls.")
    add = p.add_argument
    add("--requests", type=int, default=2000, help="recorded requests per side at c=1")
    add("--warmup", type=int, default=200, help="unrecorded requests before each c=1 case")
    add("--concurrency", type=int, default=32, help="concurrent clients, throughput cases")
    add("--duration", type=float, default=5.0, help="seconds per side, throughput cases")
    add("--upstreams", type=int, default=2, help="fixed-response upstreams behind the router")
    add("--chunks", type=int, default=16, help="SSE events per streamed upstream reply")
    add("--no-stream", action="store_true", help="skip the streaming cases")
    add("--json", type=Path, metavar="OUT", help="also write the results here as JSON")
    add(
        "--router-cmd",
        default=DEFAULT_ROUTER_CMD,
        help="router command template, to measure another router the same way; fields: "
        "{python} {port} {replicas} (space-separated URLs) {replica_flags} "
        "(default: %(default)r)",
    )
    add("--ready-path", default="/ready", help="router path that is 200 once it can route")
    args = p.parse_args(argv)
    for name in ("requests", "concurrency", "upstreams", "chunks"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    if args.duration <= 0 or args.warmup < 0:
        p.error("--duration must be > 0 and --warmup >= 0")
    return args


def build_cases(args: argparse.Namespace) -> list[Case]:
    """Latency at c=1 and throughput at c=N, plain and (unless --no-stream) streaming."""
    kinds = [("completions", False)]
    if not args.no_stream:
        kinds.append((f"stream {args.chunks}ev", True))
    cases = []
    for name, stream in kinds:
        # Streaming latency runs a quarter of the requests: each one costs more.
        n = args.requests // 4 if stream else args.requests
        cases.append(
            Case(f"{name} c=1", stream, 1, requests=max(1, n), warmup_requests=args.warmup)
        )
        cases.append(
            Case(
                f"{name} c={args.concurrency}",
                stream,
                args.concurrency,
                duration_s=args.duration,
                warmup_s=THROUGHPUT_WARMUP_S,
            )
        )
    return cases


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    services: list[Service] = []
    ctx = multiprocessing.get_context("spawn")
    parent_conn, child_conn = ctx.Pipe()
    client = ctx.Process(target=client_main, args=(child_conn,), name="load-client")
    log_dir = Path(tempfile.mkdtemp(prefix="dpserve-bench-"))
    try:
        *up_ports, router_port = free_ports(args.upstreams + 1)
        upstream_urls = [f"http://{HOST}:{p}" for p in up_ports]
        for i, port in enumerate(up_ports):
            flags = f"--host {HOST} --port {port} --model {MODEL} --chunks {args.chunks}"
            argv = [sys.executable, str(FIXED_UPSTREAM), *flags.split()]
            services.append(start_service(f"upstream{i}", argv, log_dir))
        for service, url in zip(services, upstream_urls, strict=True):
            wait_until_ok(service, f"{url}/health")
        router = start_service(
            "router", router_argv(args.router_cmd, upstream_urls, router_port), log_dir
        )
        services.append(router)
        router_url = f"http://{HOST}:{router_port}"
        t0 = time.monotonic()
        wait_until_ok(router, router_url + args.ready_path)
        ready_s = time.monotonic() - t0
        client.start()

        upstream_cpu = CpuMeter([s.proc.pid for s in services[:-1]])
        all_cpu = CpuMeter([s.proc.pid for s in services])
        direct_all = [f"{u}/v1/completions" for u in upstream_urls]
        via_router = [f"{router_url}/v1/completions"]
        results: list[tuple[Case, Side, Side]] = []
        for case in build_cases(args):
            direct_urls = direct_all[:1] if case.concurrency == 1 else direct_all
            direct = measure(parent_conn, case, direct_urls, upstream_cpu)
            routed = measure(parent_conn, case, via_router, all_cpu)
            results.append((case, direct, routed))
            if router.proc.poll() is not None:
                raise RuntimeError(
                    f"router exited with code {router.proc.returncode} during "
                    f"'{case.label}'; its output:\n{router.log_tail()}"
                )
        parent_conn.send(None)
        client.join(10)

        report(args, results, router_argv_used=router.proc.args, ready_s=ready_s)
        if any(r.errors for _, _, r in results):
            print(f"\nrouter log tail ({router.log.name}):\n{router.log_tail()}")
        return 0
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted; stopping every process started", file=sys.stderr)
        return 130
    finally:
        if client.is_alive():
            client.kill()
            client.join(5)
        for service in reversed(services):
            service.stop()


def report(
    args: argparse.Namespace,
    results: list[tuple[Case, Side, Side]],
    *,
    router_argv_used: Any,
    ready_s: float,
) -> None:
    cores = os.cpu_count() or 0
    processes = args.upstreams + 2
    print(
        f"\ndpserve router overhead: {args.upstreams} fixed-response upstreams, "
        f"router ready after {ready_s:.1f} s"
    )
    print(f"router: {shlex.join(str(a) for a in router_argv_used)}")
    print(
        f"cores: {cores}; the load client, the router and {args.upstreams} upstreams "
        f"({processes} processes) share them",
        end="",
    )
    print(
        " - throughput ratios include CPU contention, not only router cost\n"
        if cores < processes * 2
        else "\n"
    )
    print(render(table_rows(results)))

    print()
    for case, d, r in results:
        spread = ", ".join(f"{k}={v}" for k, v in sorted(r.replicas.items()))
        errors = f"errors direct {d.errors} router {r.errors}"
        samples = "; ".join(r.error_samples + d.error_samples)
        print(
            f"{case.label:<24} n direct {d.completed} router {r.completed}; {errors}"
            f"{' (' + samples + ')' if samples else ''}; router replicas: {spread}"
        )

    _, direct_c1, router_c1 = results[0]
    added = None
    if direct_c1.p50_ms is not None and router_c1.p50_ms is not None:
        added = router_c1.p50_ms - direct_c1.p50_ms
    target_met = added is not None and added <= TARGET_ADDED_P50_MS
    measured = "nothing (no successful requests)" if added is None else f"{added:+.3f} ms"
    print(
        f"\ntarget: p50 added latency at c=1 <= {TARGET_ADDED_P50_MS:.0f} ms; "
        f"measured {measured} -> {'MET' if target_met else 'NOT MET'}"
    )
    _, direct_tp, router_tp = results[1]
    ratio = router_tp.req_per_s / direct_tp.req_per_s if direct_tp.req_per_s else 0.0
    print(
        f"throughput at c={args.concurrency}: router {router_tp.req_per_s:.0f} req/s = "
        f"{ratio:.2f}x direct ({direct_tp.req_per_s:.0f} req/s)"
    )

    if args.json:
        payload = {
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "cores": cores,
            "router_argv": [str(a) for a in router_argv_used],
            "router_ready_s": ready_s,
            "target_added_p50_ms": TARGET_ADDED_P50_MS,
            "added_p50_ms": added,
            "target_met": target_met,
            "throughput_ratio": ratio,
            "cases": [
                {"case": asdict(case), "direct": asdict(d), "router": asdict(r)}
                for case, d, r in results
            ],
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=2, default=str))
        print(f"results written to {args.json}")


if __name__ == "__main__":
    sys.exit(main())
