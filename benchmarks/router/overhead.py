"""What the dpserve router costs, beside a direct connection and beside vllm-router.

One run measures three targets one after the other, on the same fixed-response
upstreams, with the same load generator and the same CPU placement:

- **direct** — requests sent straight to the upstreams (the floor);
- **dpserve** — ``python -m dpserve router --replica URL ...`` (the checkout's code);
- **vllm-router** — the Rust router from PyPI (``vllm-router``, pinned version,
  ``--policy round_robin``, its cheapest), pip-installed into the throwaway
  ``build/bench-venv`` when not on PATH; ``--no-vllm-router`` skips it.

Cases, each after an unrecorded warm-up:

1. ``completions c=1`` — ``POST /v1/completions``, small JSON: p50/p99 latency,
   and p50 added over direct (target: dpserve adds <= 0.3 ms).
2. ``completions c=C`` (C=32) — req/s for ``--duration`` s, the router's CPU per
   request (psutil) and latency (target: dpserve >= 0.5x vllm-router's req/s).
3. ``stream c=1`` / ``stream c=C`` — ``POST /v1/chat/completions`` with
   ``"stream": true``: time to the first and the last byte at c=1, added over
   direct; req/s at c=C.
4. ``paced stream`` — the same request against a Python upstream that leaves
   ``--chunk-delay-ms`` between SSE events (a router instance of its own points
   at it). The client notes when each event arrives; a router that holds chunks
   back (buffers, or meets Nagle's algorithm) delays later events more than the
   first and delivers several in one read. Reported: per-chunk delay added over
   direct = the median, over event positions, of (added delay of event i - added
   delay of the first event), and the share of events that came in the same
   read as the one before (target: dpserve adds <= 1 ms per chunk and coalesces
   no more events than direct).

**Upstreams.** nginx from the distribution when installed (one master + one
worker listening on ``--upstreams`` ports, ``return 200 '<fixed body>'``, config
and every file it writes in the temp dir, as the current user), else
``benchmarks/router/fixed_upstream.py``. See ``upstreams.py``.

**Load generator.** wrk when installed, else the aiohttp client
(``load_client.py``), for cases 1, 2 and the c=C streams. wrk's latency histogram
has 1 us resolution and its ``done`` hook gives exact percentiles, so it is good
enough for a 0.3 ms target; being C it adds less and steadier time of its own
than a Python client, so the direct floor is lower and the added latency is the
router's. The aiohttp client still runs c=1 as a cross-check (its p50 row) and
all c=1 streaming cases, since wrk cannot time single chunks.

**CPU placement** (``--no-pin`` to leave it to the kernel). The router under
test runs alone on the last core; on two cores the load generator and the
upstreams share the other one, on more the upstreams get one of their own. So
each router gets exactly one core: dpserve is one Python process and
vllm-router's thread pool sizes itself from the cores it may use, and both are
compared per core, under the same placement. The direct target runs with the
same placement (minus the router). ``--router-cores K`` gives each router the last
K cores instead (the upstreams the K before them, nginx one worker per core, the
load generator the rest: 2K+1 cores at least); with ``--workers-too K`` the
dpserve-workers column runs one process per core.

**Rounds** (``--rounds N``): every target is measured N times, interleaved
(direct, dpserve, vllm-router, direct, vllm-router, dpserve, ...: the routers'
order reverses every other round, since the one measured first in a round spends
10-15% more CPU per request), and each number reported is the median over the
rounds, so a burst of other work on the machine spoils one round rather than one
target's column. Use an even N to compare two routers.

**Profile** (``--profile``): one more c=C run against dpserve with py-spy
attached (installed into the throwaway venv when absent), after the measured
one so it does not slow the numbers; writes a speedscope file and collapsed
stacks and prints self time by function and by layer (``pyspy.py``).

Every process runs in its own process group on 127.0.0.1 and free ports, and is
stopped in ``finally`` (SIGTERM, then SIGKILL), on Ctrl-C and SIGTERM too. The
script exits 0 when the run completed, whether or not a target was met.

    python -m benchmarks.router.overhead [--duration 5] [--concurrency 32] [--rounds 1]
        [--json OUT] [--profile] [--no-vllm-router] [--no-stream] [--no-pin] [--dpserve-ref REF]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from types import FrameType
from typing import Any

from benchmarks.common.services import (
    HOST,
    Service,
    free_ports,
    pin_self,
    plan_placement,
    start_service,
    stop_all,
)
from benchmarks.common.tools import (
    PY_SPY_SPEC,
    REPO,
    VLLM_ROUTER_SPEC,
    ensure_tool,
    export_ref,
    vllm_router_argv,
    vllm_router_version,
)
from benchmarks.router.load_client import client_main
from benchmarks.router.overhead_measure import (
    Bench,
    Env,
    Router,
    StartRouter,
    TargetResult,
    merge_rounds,
)
from benchmarks.router.overhead_report import TARGETS, print_report, verdicts
from benchmarks.router.upstreams import (
    NGINX_HINT,
    find_nginx,
    nginx_version,
    start_nginx,
    start_python_upstream,
)
from benchmarks.router.wrk import WRK_HINT, find_wrk, wrk_version

DEFAULT_ROUTER_CMD = "{python} -m dpserve router {replica_flags} --host 127.0.0.1 --port {port}"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = p.add_argument
    add("--duration", type=float, default=5.0, help="seconds per recorded wrk/throughput run")
    add("--rounds", type=int, default=1,
        help="measure every target this many times, interleaved; report the medians")
    add("--concurrency", type=int, default=32, help="concurrent connections, throughput cases")
    add("--requests", type=int, default=2000,
        help="recorded requests per target, aiohttp c=1 case (streaming: a quarter)")
    add("--warmup", type=int, default=200, help="unrecorded requests before each aiohttp c=1 case")
    add("--upstreams", type=int, default=2, help="fixed-response upstreams behind the routers")
    add("--chunks", type=int, default=16, help="SSE events per streamed reply")
    add("--chunk-delay-ms", type=float, default=10.0, help="gap between events, paced stream")
    add("--paced-requests", type=int, default=20, help="recorded requests, paced stream case")
    add("--no-stream", action="store_true", help="skip the streaming cases")
    add("--upstream", choices=("auto", "nginx", "python"), default="auto",
        help="upstream server (auto: nginx when installed)")
    add("--load", choices=("auto", "wrk", "aiohttp"), default="auto",
        help="load generator (auto: wrk when installed)")
    add("--no-pin", action="store_true", help="do not pin processes to cores")
    add("--router-cores", type=int, default=1, metavar="K",
        help="cores each router under test gets (upstreams get as many, the load the rest; "
             "needs 2K+1 cores); with --workers-too K, dpserve runs one process per core")
    add("--no-vllm-router", action="store_true", help="do not measure vllm-router")
    add("--migration-off-too", action="store_true",
        help="also measure dpserve with stream migration off (--migration-limit 0): what "
             "tracking every stream's token ids costs")
    add("--workers-too", type=int, metavar="N",
        help="also measure dpserve with --workers N (column dpserve-workers); with --no-pin "
             "every router may use every core")
    add("--vllm-router-spec", default=VLLM_ROUTER_SPEC, help="pip spec installed when absent")
    add("--vllm-router-policy", default="round_robin", help="vllm-router --policy")
    add("--router-cmd", default=DEFAULT_ROUTER_CMD,
        help="dpserve's command template; fields {python} {port} {replicas} {replica_flags}")
    add("--ready-path", default="/ready", help="dpserve path that is 200 once it can route")
    add("--dpserve-ref", metavar="REF",
        help="measure dpserve as committed at REF (git archive into the temp dir) instead of "
             "the working tree, e.g. HEAD while the tree is being edited, or to compare two")
    add("--baseline-ref", metavar="REF",
        help="also measure dpserve as committed at REF (column dpserve-baseline), "
             "interleaved with the others: a before/after in one run")
    add("--profile", action="store_true", help="py-spy the dpserve router in a c=C run")
    add("--profile-dir", type=Path, help="where profile files go (default runs/profile-TIME)")
    add("--profile-rate", type=int, default=200, help="py-spy samples per second")
    add("--json", type=Path, metavar="OUT", help="also write every number here as JSON")
    add("--keep-logs", action="store_true", help="keep the temp dir with logs and configs")
    args = p.parse_args(argv)
    if args.router_cores < 1:
        p.error("--router-cores must be at least 1")
    if args.workers_too is not None and args.workers_too < 2:
        p.error("--workers-too must be at least 2")
    for name in ("requests", "concurrency", "upstreams", "chunks", "paced_requests", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.duration < 1 or args.warmup < 0 or args.chunk_delay_ms <= 0:
        p.error("--duration must be >= 1, --warmup >= 0 and --chunk-delay-ms > 0")
    return args


def discover(args: argparse.Namespace) -> Env:
    """Find (or install) the tools; say what falls back and why."""
    try:
        env = Env(placement=plan_placement(not args.no_pin, args.router_cores))
    except ValueError as exc:
        raise RuntimeError(str(exc)) from None
    if args.upstream != "python":
        env.nginx = find_nginx()
        if env.nginx is None:
            if args.upstream == "nginx":
                raise RuntimeError(NGINX_HINT.split(";")[0] + " (--upstream nginx)")
            print(f"note: {NGINX_HINT}")
        else:
            env.versions["nginx"] = nginx_version(env.nginx)
    if args.load != "aiohttp":
        env.wrk = find_wrk()
        if env.wrk is None:
            if args.load == "wrk":
                raise RuntimeError(WRK_HINT.split(";")[0] + " (--load wrk)")
            print(f"note: {WRK_HINT}")
        else:
            env.versions["wrk"] = wrk_version(env.wrk)
    if not args.no_vllm_router:
        try:
            env.vllm_router = ensure_tool("vllm-router", args.vllm_router_spec)
            env.versions["vllm-router"] = vllm_router_version(env.vllm_router)
        except RuntimeError as exc:
            print(f"note: vllm-router is not measured: {exc}\n  (pip must reach PyPI; "
                  "or put vllm-router on PATH; --no-vllm-router silences this)")
    if args.profile:
        try:
            env.py_spy = ensure_tool("py-spy", PY_SPY_SPEC)
        except RuntimeError as exc:
            print(f"note: no profile: {exc}")
    env.versions["dpserve"] = _git_describe(args.dpserve_ref)
    if args.baseline_ref:
        env.versions["dpserve-baseline"] = _git_describe(args.baseline_ref)
    return env


def _git_describe(ref: str | None) -> str:
    """The commit measured: ``ref``'s, or the working tree's (``-dirty`` if edited)."""
    argv = ["git", "-C", str(REPO), "describe", "--always"]
    argv += [ref] if ref else ["--dirty"]
    out = subprocess.run(argv, capture_output=True, text=True, check=False)
    return out.stdout.strip() or "?"


def router_argv(
    template: str, replicas: Sequence[str], port: int, cwd: Path | None = None
) -> list[str]:
    """dpserve's command line; adds ``--log-level warning`` when it accepts the flag."""
    argv = shlex.split(template.format(
        python=shlex.quote(sys.executable), port=port, replicas=" ".join(replicas),
        replica_flags=" ".join(f"--replica {r}" for r in replicas),
    ))
    if template == DEFAULT_ROUTER_CMD:
        probe = subprocess.run([sys.executable, "-m", "dpserve", "router", "--help"],
                               capture_output=True, text=True, timeout=60, check=False, cwd=cwd)
        if probe.returncode != 0:
            raise RuntimeError("`python -m dpserve router --help` failed "
                               f"(code {probe.returncode}):\n{probe.stderr.strip()[-2000:]}")
        if "--log-level" in probe.stdout:
            argv += ["--log-level", "warning"]
    return argv


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # SIGTERM: stop everything the way Ctrl-C does


def router_starter(
    args: argparse.Namespace, env: Env, work_dir: Path, services: list[Service]
) -> StartRouter:
    """Start a target's router in front of some upstreams, on the router's core.

    With ``--dpserve-ref`` dpserve runs from the exported tree: ``python -m`` puts
    the working directory first on ``sys.path``, ahead of the editable install.
    """
    src = export_ref(args.dpserve_ref, work_dir) if args.dpserve_ref else None
    baseline = (export_ref(args.baseline_ref, work_dir / "baseline")
                if args.baseline_ref else None)

    def start(name: str, upstreams: Sequence[str]) -> Router | None:
        if name == "direct":
            return None
        port, metrics_port = free_ports(2)
        cwd = None
        if name.startswith("dpserve"):
            cwd = baseline if name == "dpserve-baseline" else src
            argv = router_argv(args.router_cmd, upstreams, port, cwd)
            if name == "dpserve-no-migration":
                argv += ["--migration-limit", "0"]
            if name == "dpserve-workers":
                argv += ["--workers", str(args.workers_too)]
            ready = args.ready_path
        else:
            assert env.vllm_router is not None
            argv = vllm_router_argv(env.vllm_router, upstreams, port, metrics_port,
                                    args.vllm_router_policy)
            ready = "/readiness"
        service = start_service(name, argv, work_dir, cpus=env.placement.router, cwd=cwd)
        services.append(service)
        return Router(service=service, url=f"http://{HOST}:{port}", ready_path=ready)

    return start


def start_upstreams(
    args: argparse.Namespace, env: Env, work_dir: Path, services: list[Service]
) -> tuple[list[str], str | None]:
    """The fast upstreams' URLs and (unless --no-stream) the paced upstream's."""
    *ports, paced_port = free_ports(args.upstreams + 1)
    cpus = env.placement.upstream
    if env.nginx:
        services.append(start_nginx(env.nginx, ports, work_dir, chunks=args.chunks, cpus=cpus))
    else:
        for i, port in enumerate(ports):
            services.append(start_python_upstream(f"upstream{i}", port, work_dir,
                                                  chunks=args.chunks, cpus=cpus))
    paced = None
    if not args.no_stream:
        services.append(start_python_upstream(
            "paced-upstream", paced_port, work_dir, chunks=args.chunks,
            chunk_delay_ms=args.chunk_delay_ms, stamp=True, cpus=cpus))
        paced = f"http://{HOST}:{paced_port}"
    return [f"http://{HOST}:{p}" for p in ports], paced


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    work_dir = Path(tempfile.mkdtemp(prefix="dpserve-bench-"))
    services: list[Service] = []
    ctx = multiprocessing.get_context("spawn")
    parent_conn, child_conn = ctx.Pipe()
    client: Any = None
    failed = True
    try:
        env = discover(args)
        env.load_before = os.getloadavg()[0]
        pin_self(env.placement.load)
        client = ctx.Process(target=client_main, args=(child_conn, env.placement.load),
                             name="load-client", daemon=True)
        client.start()
        upstreams, paced = start_upstreams(args, env, work_dir, services)
        bench = Bench(args=args, env=env, conn=parent_conn, work_dir=work_dir,
                      services=services, start_router=router_starter(args, env, work_dir,
                                                                     services))
        names = [n for n in TARGETS if (n != "vllm-router" or env.vllm_router is not None)
                 and (n != "dpserve-no-migration" or args.migration_off_too)
                 and (n != "dpserve-workers" or args.workers_too)
                 and (n != "dpserve-baseline" or args.baseline_ref)]
        rounds: dict[str, list[TargetResult]] = {n: [] for n in names}
        for i in range(args.rounds):
            # Every other round the routers go in reverse order: measured first in a
            # round, a router spent 10-15% more CPU per request (the same code swapped
            # between columns), so an even --rounds gives each column both places.
            order = names if i % 2 == 0 else names[:1] + names[:0:-1]
            for name in order:
                of = f" (round {i + 1} of {args.rounds})" if args.rounds > 1 else ""
                print(f"measuring {name}{of} ...", flush=True)
                rounds[name].append(bench.run_target(name, upstreams, paced,
                                                     profile=args.profile and i == 0))
        results = {name: merge_rounds(r) for name, r in rounds.items()}

        print_report(args, env, results)
        if bench.profile_text:
            print(f"\n{bench.profile_text}")
        if args.json:
            _write_json(args, env, results, rounds)
        failed = False
        return 0
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted; stopping every process started", file=sys.stderr)
        failed = False  # nothing to debug: leave no temp dir behind either
        return 130
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # finish cleaning up first
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if client is not None and client.is_alive():
            client.kill()
            client.join(5)
        stop_all(services)
        if failed or args.keep_logs:
            print(f"logs and configs kept in {work_dir}", file=sys.stderr)
        else:
            shutil.rmtree(work_dir, ignore_errors=True)
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _write_json(
    args: argparse.Namespace, env: Env, results: dict[str, TargetResult],
    rounds: dict[str, list[TargetResult]],
) -> None:
    payload = {
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "cores": os.cpu_count(),
        "placement": env.placement.describe(),
        "versions": env.versions,
        "load_average_1m_before": env.load_before,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "targets": {name: asdict(r) for name, r in results.items()},
        "rounds": {name: [asdict(r) for r in rs] for name, rs in rounds.items()},
        "verdicts": verdicts(args, results),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(payload, indent=2, default=str))
    print(f"results written to {args.json}")


if __name__ == "__main__":
    sys.exit(main())
