"""The router's upstream half alone: HTTP clients against the same fixed upstreams.

```sh
.venv/bin/python -m benchmarks.router.upstream_clients [--rounds 3] [--duration 3]
    [--concurrency 32] [--kinds dpserve,aiohttp,pyreqwest,httpx] [--no-stream] [--json OUT]
```

Each client kind (`client_kinds.py`) runs in its own process, pinned alone to
the core the router gets in `overhead.py`, and sends C requests at a time
back to back to one nginx upstream (on the other core), reading each body whole
(completions) or chunk by chunk as it arrives (a 16-event SSE stream). It
measures what the router would pay for its upstream side: **CPU µs per request**
(every thread of the client process) and req/s. Rounds are interleaved (each
round runs every kind once) and the median is reported, with each kind's ratio
to dpserve's own client. pyreqwest and granian are pip-installed into
`build/bench-venv` when missing (never into `.venv`).

Exit 0 when the run completed, 1 when a process failed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from benchmarks.common.services import HOST, free_ports, plan_placement, stop_all
from benchmarks.common.tools import BENCH_VENV, REPO, ensure_tool
from benchmarks.router.client_kinds import DEFAULT_KINDS, KINDS
from benchmarks.router.upstreams import (
    find_nginx,
    nginx_version,
    request_body,
    request_path,
    start_nginx,
)

WORKER = "benchmarks.router.client_kinds"
PYREQWEST_SPEC = "pyreqwest==0.15.1"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median reported)")
    p.add_argument("--duration", type=float, default=3.0, help="recorded seconds per case")
    p.add_argument("--warmup", type=float, default=1.0, help="unrecorded seconds before each")
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight")
    p.add_argument("--chunks", type=int, default=16, help="SSE events per streamed reply")
    p.add_argument("--kinds", default=",".join(DEFAULT_KINDS),
                   help=f"comma-separated client kinds, from {', '.join(KINDS)}")
    p.add_argument("--no-stream", action="store_true", help="skip the streamed case")
    p.add_argument("--json", type=Path, help="write every number here")
    args = p.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        p.error(f"--kinds: unknown kind(s) {', '.join(unknown)}; known: {', '.join(KINDS)}")
    args.kinds = kinds
    return args


def ensure_pyreqwest() -> str:
    """pyreqwest's version in the throwaway venv, installed when missing."""
    site = next(BENCH_VENV.glob("lib/python*/site-packages"), None)
    if site is None or not (site / "pyreqwest").is_dir():
        ensure_tool("python", "pip")  # creates the venv
        subprocess.run([str(BENCH_VENV / "bin" / "python"), "-m", "pip", "install", "--quiet",
                        "--disable-pip-version-check", PYREQWEST_SPEC], check=True)
    out = subprocess.run([str(BENCH_VENV / "bin" / "python"), "-c",
                          "import importlib.metadata as m; print(m.version('pyreqwest'))"],
                         capture_output=True, text=True, check=False)
    return out.stdout.strip() or "?"


def run_case(kind: str, url: str, stream: bool, args: argparse.Namespace,
             cpus: frozenset[int]) -> dict:
    argv = [sys.executable, "-m", WORKER, "--kind", kind, "--url", url,
            "--body", request_body(stream).decode(), "--concurrency", str(args.concurrency),
            "--warmup", str(args.warmup), "--duration", str(args.duration)]
    if stream:
        argv.append("--stream")
    taskset = ["taskset", "-c", ",".join(map(str, sorted(cpus)))] if cpus else []
    out = subprocess.run(taskset + argv, capture_output=True, text=True, check=False,
                         timeout=args.warmup + args.duration + 60, cwd=REPO)
    if out.returncode != 0:
        raise RuntimeError(f"{kind} client failed (exit {out.returncode}):\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def summarise(samples: list[dict]) -> dict:
    def per(s: dict) -> tuple[float, float]:
        n = max(1, s["requests"])
        return s["requests"] / s["wall_s"], s["cpu_s"] / n * 1e6

    rates, cpus = zip(*(per(s) for s in samples), strict=True)
    return {"req_s": statistics.median(rates), "cpu_us": statistics.median(cpus),
            "errors": sum(s["errors"] for s in samples), "rounds": len(samples)}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    nginx = find_nginx()
    if nginx is None:
        print("nginx is required: `sudo apt-get install -y nginx-light`", file=sys.stderr)
        return 1
    versions = {"nginx": nginx_version(nginx)}
    if "pyreqwest" in args.kinds:
        versions["pyreqwest"] = ensure_pyreqwest()
    placement = plan_placement(True)
    print(f"placement: client alone on core(s) {sorted(placement.router) or 'any'}, "
          f"nginx on {sorted(placement.upstream) or 'any'}", flush=True)
    services: list = []
    cases = [False] if args.no_stream else [False, True]
    samples: dict[tuple[str, bool], list[dict]] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="dpserve-clients-") as tmp:
            port = free_ports(1)[0]
            services.append(start_nginx(nginx, [port], Path(tmp), chunks=args.chunks,
                                        cpus=placement.upstream))
            for rnd in range(args.rounds):
                for stream in cases:
                    url = f"http://{HOST}:{port}{request_path(stream)}"
                    for kind in args.kinds:
                        print(f"round {rnd + 1}/{args.rounds}: {kind} "
                              f"{'stream' if stream else 'completions'} ...", flush=True)
                        samples.setdefault((kind, stream), []).append(
                            run_case(kind, url, stream, args, placement.router))
    except (RuntimeError, subprocess.SubprocessError) as exc:
        print(f"failed: {exc}", file=sys.stderr)
        return 1
    finally:
        stop_all(services)

    report = {"args": {k: str(v) for k, v in vars(args).items()}, "versions": versions,
              "results": {}}
    print(f"\nversions: {versions}\n")
    print(f"{'case':<14}{'client':<12}{'req/s':>10}{'CPU us/req':>12}{'vs dpserve':>12}"
          f"{'errors':>8}")
    for stream in cases:
        base = summarise(samples[("dpserve", stream)])["cpu_us"] \
            if ("dpserve", stream) in samples else None
        name = f"stream {args.chunks}ev" if stream else "completions"
        for kind in args.kinds:
            s = summarise(samples[(kind, stream)])
            ratio = f"{s['cpu_us'] / base:.2f}x" if base else "-"
            print(f"{name:<14}{kind:<12}{s['req_s']:>10,.0f}{s['cpu_us']:>12.1f}{ratio:>12}"
                  f"{s['errors']:>8}")
            report["results"][f"{name}/{kind}"] = {**s, "samples": samples[(kind, stream)]}
    print("\n(CPU us/req: the client process's user+system time per completed request; "
          "vs dpserve: that CPU over dpserve's own client's)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
