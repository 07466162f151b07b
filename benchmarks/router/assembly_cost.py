"""The router's CPU for a non-streamed request riding on a stream, and for a stream with
stop strings, each beside today's path in the same run.

Two fixed upstreams (`fixed_upstream.py`: a JSON answer, or `--chunks` SSE events
when asked for a stream) behind `python -m dpserve router`, started once per arm and
round, the arms alternated (each goes first in some rounds):

- `json`: `DPSERVE_ASSEMBLE_RESPONSES=false`, a non-streamed completion forwarded
  whole (the path before assembly);
- `ride`: default settings, the same request asked as a stream and assembled;
- `stream`: a streamed completion;
- `stream+stop`: the same with `"stop": ["zzzz"]` (never met): every event's text
  is read.

Per arm: router CPU (user + system, psutil) per request over `--requests` requests at
`--concurrency`, and the ratios ride/json and stream+stop/stream (target: at most
1.3x each). The upstream's own work is not counted.

    python -m benchmarks.router.assembly_cost [--requests 3000] [--rounds 4] [--chunks 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from benchmarks.common.services import (
    CpuMeter,
    Service,
    free_ports,
    start_service,
    stop_all,
    wait_until_ok,
)

MODEL = "fixed-model"
ARMS = ("json", "ride", "stream", "stream+stop")


def request_of(arm: str) -> dict[str, object]:
    body: dict[str, object] = {"model": MODEL, "prompt": "Once upon a time",
                               "max_tokens": 16, "temperature": 0}
    if arm.startswith("stream"):
        body["stream"] = True
    if arm == "stream+stop":
        body["stop"] = ["zzzz"]
    return body


async def load(url: str, body: bytes, n: int, concurrency: int) -> int:
    """`n` requests, `concurrency` at a time; how many failed."""
    failed = 0
    left = n

    async def one(session: aiohttp.ClientSession) -> None:
        nonlocal failed, left
        while left > 0:
            left -= 1
            async with session.post(url, data=body,
                                    headers={"content-type": "application/json"}) as r:
                await r.read()
                failed += r.status != 200

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(one(session) for _ in range(concurrency)))
    return failed


def measure(arm: str, upstreams: list[str], args: argparse.Namespace, log_dir: Path,
            services: list[Service]) -> float:
    """Router CPU µs per request of one arm, on a router started for it."""
    (port,) = free_ports(1)
    env = os.environ | {"DPSERVE_ASSEMBLE_RESPONSES": "false" if arm == "json" else "true",
                        "DPSERVE_LOG_LEVEL": "warning"}
    argv = [sys.executable, "-m", "dpserve", "router", "--host", "127.0.0.1", "--port",
            str(port), "--policy", "round-robin",
            *(f for u in upstreams for f in ("--replica", u))]
    router = start_service(f"router-{arm}", argv, log_dir, env=env)
    services.append(router)
    try:
        wait_until_ok(router, f"http://127.0.0.1:{port}/ready")
        url = f"http://127.0.0.1:{port}/v1/completions"
        body = json.dumps(request_of(arm)).encode()
        asyncio.run(load(url, body, args.warmup, args.concurrency))
        meter = CpuMeter([router.pid])
        before = meter.seconds() or 0.0
        failed = asyncio.run(load(url, body, args.requests, args.concurrency))
        spent = (meter.seconds() or 0.0) - before
        if failed:
            raise RuntimeError(f"{arm}: {failed} of {args.requests} requests failed; "
                               f"router log:\n{router.log_tail()}")
        return spent / args.requests * 1e6
    finally:
        router.stop()
        services.remove(router)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--warmup", type=int, default=300)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--chunks", type=int, default=16, help="SSE events per streamed answer")
    args = p.parse_args()
    services: list[Service] = []
    with tempfile.TemporaryDirectory(prefix="dpserve-assembly-") as work:
        log_dir = Path(work)
        try:
            ports = free_ports(2)
            for port in ports:
                up = start_service(f"upstream-{port}", [
                    sys.executable, "-m", "benchmarks.router.fixed_upstream", "--port",
                    str(port), "--model", MODEL, "--chunks", str(args.chunks)], log_dir)
                services.append(up)
                wait_until_ok(up, f"http://127.0.0.1:{port}/health")
            upstreams = [f"http://127.0.0.1:{port}" for port in ports]
            got: dict[str, list[float]] = {arm: [] for arm in ARMS}
            for i in range(args.rounds):
                for arm in (ARMS if i % 2 == 0 else ARMS[::-1]):
                    started = time.monotonic()
                    got[arm].append(measure(arm, upstreams, args, log_dir, services))
                    print(f"round {i + 1}: {arm:<12} {got[arm][-1]:7.0f} µs/request "
                          f"({time.monotonic() - started:.0f} s)", flush=True)
        finally:
            stop_all(services)
    print(f"\nrouter CPU per request, median of {args.rounds} rounds "
          f"({args.requests} requests each, c={args.concurrency}, {args.chunks} events):")
    med = {arm: statistics.median(v) for arm, v in got.items()}
    for arm in ARMS:
        print(f"  {arm:<12} {med[arm]:7.0f} µs   (rounds: "
              f"{', '.join(f'{x:.0f}' for x in got[arm])})")
    for new, old in (("ride", "json"), ("stream+stop", "stream")):
        ratios = [a / b for a, b in zip(got[new], got[old], strict=True)]
        ratio = med[new] / med[old]
        print(f"  {new} / {old}: {ratio:.2f}x (per round {min(ratios):.2f}-{max(ratios):.2f}x)"
              f"  target <= 1.3x: {'PASS' if ratio <= 1.3 else 'MISS'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
