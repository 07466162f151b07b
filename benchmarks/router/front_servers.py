"""The router's front half alone: HTTP servers answering a fixed reply, under wrk.

```sh
.venv/bin/python -m benchmarks.router.front_servers [--rounds 3] [--duration 3] [--concurrency 32]
    [--servers uvicorn-guarded,uvicorn,granian-asgi,granian-rsgi] [--json OUT]
```

Every server runs the same fixed-response app (`front_apps.py`: read the body,
answer the completion JSON with a content-length), alone on the core the
router gets in `overhead.py`; wrk drives it from the other core with the
benchmark's POST body, at c=1 (latency) and c=C (throughput). What is measured
is each server's own cost per request: **CPU µs per request** (psutil, the
server process and its threads) and req/s at c=C, p50 at c=1.

- ``uvicorn-guarded``: uvicorn + httptools with dpserve's `GuardedProtocol`
  (the head/body deadlines and size caps of `dpserve.router.http.front`), as the
  router serves today;
- ``uvicorn-guarded-2w``: the same without the one-write cycle
  (`dpserve.router.http.front_cycle`): head and body in two writes, as uvicorn does;
- ``uvicorn``: uvicorn's own httptools protocol (what the guard costs);
- ``granian-asgi``, ``granian-rsgi``: granian (a Rust server on hyper), one
  worker process, one runtime thread, uvloop, its ASGI and its RSGI interface.

granian is pip-installed into `build/bench-venv` when missing (never into
`.venv`). Rounds are interleaved; medians are reported with each server's ratio
to ``uvicorn-guarded``. Exit 0 when the run completed, 1 when a process failed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.common.services import (
    HOST,
    CpuMeter,
    free_ports,
    pin_self,
    plan_placement,
    start_service,
    stop_all,
    wait_until_ok,
)
from benchmarks.common.tools import REPO, ensure_tool, tool_version
from benchmarks.router.upstreams import request_body
from benchmarks.router.wrk import find_wrk, run_wrk, write_script, wrk_version

SERVERS = ("uvicorn-guarded", "uvicorn-guarded-2w", "uvicorn", "granian-asgi", "granian-rsgi")
GRANIAN_SPEC = "granian==2.8.7 uvloop"
APPS = "benchmarks.router.front_apps"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median reported)")
    p.add_argument("--duration", type=float, default=3.0, help="recorded seconds per case")
    p.add_argument("--concurrency", type=int, default=32, help="connections at c=C")
    p.add_argument("--servers", default=",".join(SERVERS),
                   help=f"comma-separated, from {', '.join(SERVERS)}")
    p.add_argument("--json", type=Path, help="write every number here")
    args = p.parse_args(argv)
    args.servers = [s for s in args.servers.split(",") if s]
    unknown = sorted(set(args.servers) - set(SERVERS))
    if unknown:
        p.error(f"--servers: unknown {', '.join(unknown)}; known: {', '.join(SERVERS)}")
    return args


def server_argv(name: str, port: int, granian: str | None) -> tuple[list[str], dict[str, str]]:
    env = dict(os.environ)
    if name.startswith("uvicorn"):
        argv = [sys.executable, "-m", APPS, "--port", str(port)]
        extra = {"uvicorn": ["--plain"], "uvicorn-guarded-2w": ["--two-writes"]}.get(name, [])
        return [*argv, *extra], env
    assert granian is not None
    interface = name.removeprefix("granian-")
    env["PYTHONPATH"] = str(REPO)
    return [granian, "--interface", interface, "--host", HOST, "--port", str(port),
            "--workers", "1", "--runtime-threads", "1", "--runtime-mode", "st",
            "--loop", "uvloop", "--no-ws", "--no-access-log", "--log-level", "warning",
            f"{APPS}:{interface}_app"], env


def measure(name: str, args: argparse.Namespace, placement, wrk: str, script: Path,
            granian: str | None, work_dir: Path) -> dict:
    port = free_ports(1)[0]
    argv, env = server_argv(name, port, granian)
    service = start_service(name, argv, work_dir, cpus=placement.router, env=env, cwd=REPO)
    try:
        url = f"http://{HOST}:{port}/v1/completions"
        deadline = time.monotonic() + 30
        while True:  # the apps answer any path; a GET has no body to wait for
            try:
                wait_until_ok(service, url, timeout_s=2)
                break
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
        run_wrk(wrk, url, script, connections=args.concurrency, threads=1, duration_s=1)
        c1 = run_wrk(wrk, url, script, connections=1, threads=1, duration_s=args.duration)
        meter = CpuMeter([service.pid])
        cpu0 = meter.seconds()
        cc = run_wrk(wrk, url, script, connections=args.concurrency, threads=1,
                     duration_s=args.duration)
        cpu1 = meter.seconds()
        service.check_alive("the measurement")
        cpu_us = ((cpu1 - cpu0) / max(1, cc.requests) * 1e6
                  if cpu0 is not None and cpu1 is not None else float("nan"))
        return {"c1_p50_ms": c1.p50_ms, "c1_p99_ms": c1.p99_ms, "req_s": cc.req_per_s,
                "p50_ms": cc.p50_ms, "p99_ms": cc.p99_ms, "cpu_us": cpu_us,
                "errors": c1.errors + cc.errors}
    finally:
        service.stop()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    wrk = find_wrk()
    if wrk is None:
        print("wrk is required: `sudo apt-get install -y wrk`", file=sys.stderr)
        return 1
    granian = None
    if any(s.startswith("granian") for s in args.servers):
        granian = ensure_tool("granian", GRANIAN_SPEC)
    placement = plan_placement(True)
    pin_self(placement.load)  # wrk inherits it
    print(f"server alone on core(s) {sorted(placement.router) or 'any'}; wrk on "
          f"{sorted(placement.load) or 'any'}; load average {os.getloadavg()[0]:.2f}", flush=True)
    samples: dict[str, list[dict]] = {s: [] for s in args.servers}
    try:
        with tempfile.TemporaryDirectory(prefix="dpserve-fronts-") as tmp:
            work_dir = Path(tmp)
            script = write_script(work_dir / "post.lua", request_body(False))
            for rnd in range(args.rounds):
                for name in args.servers:
                    print(f"round {rnd + 1}/{args.rounds}: {name} ...", flush=True)
                    samples[name].append(measure(name, args, placement, wrk, script, granian,
                                                 work_dir))
    except (RuntimeError, subprocess.SubprocessError) as exc:
        print(f"failed: {exc}", file=sys.stderr)
        return 1
    finally:
        stop_all([])

    versions = {"wrk": wrk_version(wrk),
                "granian": tool_version([granian, "--version"]) if granian else "-"}
    print(f"\nversions: {versions}\n")
    base = "uvicorn-guarded" if "uvicorn-guarded" in samples else args.servers[0]
    med = {name: {k: statistics.median(s[k] for s in runs) for k in runs[0]}
           for name, runs in samples.items()}
    print(f"{'server':<18}{'c=1 p50 ms':>12}{'req/s c=' + str(args.concurrency):>14}"
          f"{'p99 ms':>9}{'CPU us/req':>12}{'CPU vs ' + base:>26}")
    for name, m in med.items():
        ratio = m["cpu_us"] / med[base]["cpu_us"]
        print(f"{name:<18}{m['c1_p50_ms']:>12.3f}{m['req_s']:>14,.0f}{m['p99_ms']:>9.2f}"
              f"{m['cpu_us']:>12.1f}{ratio:>25.2f}x")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "versions": versions, "median": med,
                                         "samples": samples}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
