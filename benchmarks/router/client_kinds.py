"""One HTTP client kind driving fixed-response upstreams: the worker of `upstream_clients.py`.

Run as its own process, pinned to the core the router would have, so its CPU
time is the client's alone. C tasks send back to back for a warm-up and then
for the recorded duration, each a POST with the benchmark's body; the body is
read whole (`--no-stream`) or chunk by chunk as it arrives (`--stream`), as the
router's data plane does. Prints one JSON line: requests, errors, wall and CPU
seconds of the recorded part (``os.times``: every thread of the process, so a
client that works on a thread of its own, as pyreqwest's runtime does, pays for
it).

Kinds: ``dpserve`` (`dpserve.router.upstream.client.UpstreamPool`, the router's own),
``aiohttp`` (a ClientSession with a keep-alive connector), ``pyreqwest`` (Rust
reqwest through pyreqwest, one client), ``httpx`` (an AsyncClient).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable

from benchmarks.common.tools import BENCH_VENV

BENCH_SITE = BENCH_VENV / "lib" / (
    f"python{sys.version_info.major}.{sys.version_info.minor}") / "site-packages"

Send = Callable[[], Awaitable[int]]
KINDS = ("dpserve", "aiohttp", "pyreqwest", "httpx")
DEFAULT_KINDS = ("dpserve", "aiohttp", "pyreqwest")


async def make_dpserve(url: str, body: bytes, stream: bool) -> tuple[Send, Callable]:
    from dpserve.router.upstream.client import Origin, UpstreamPool

    pool = UpstreamPool()
    origin = Origin.parse(url)
    path = url.split("/", 3)[3]
    head = (f"POST /{path} HTTP/1.1\r\nhost: {origin.host_header.decode()}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n").encode()

    async def send() -> int:
        response = await pool.request(origin, head, body, connect_timeout_s=5.0,
                                      head_timeout_s=30.0)
        try:
            if stream:
                size = 0
                while chunk := await response.readany():
                    size += len(chunk)
            else:
                size = len(await response.read())
        finally:
            response.release()
        return size

    async def close() -> None:
        pool.close()

    return send, close


async def make_aiohttp(url: str, body: bytes, stream: bool) -> tuple[Send, Callable]:
    import aiohttp

    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    headers = {"content-type": "application/json"}

    async def send() -> int:
        async with session.post(url, data=body, headers=headers) as response:
            if stream:
                size = 0
                async for chunk in response.content.iter_any():
                    size += len(chunk)
                return size
            return len(await response.read())

    return send, session.close


async def make_pyreqwest(url: str, body: bytes, stream: bool) -> tuple[Send, Callable]:
    from pyreqwest.client import ClientBuilder

    client = ClientBuilder().http1_only().build()
    headers = {"content-type": "application/json"}

    async def send() -> int:
        builder = client.post(url).headers(headers).body_bytes(body)
        if stream:
            size = 0
            async with builder.build_streamed() as response:
                reader = response.body_reader
                while (chunk := await reader.read_chunk()) is not None:
                    size += len(chunk)
            return size
        response = await builder.build().send()
        return len(await response.bytes())

    return send, client.close


async def make_httpx(url: str, body: bytes, stream: bool) -> tuple[Send, Callable]:
    import httpx

    client = httpx.AsyncClient(limits=httpx.Limits(max_connections=None,
                                                   max_keepalive_connections=None))
    headers = {"content-type": "application/json"}

    async def send() -> int:
        if stream:
            size = 0
            async with client.stream("POST", url, content=body, headers=headers) as response:
                async for chunk in response.aiter_raw():
                    size += len(chunk)
            return size
        response = await client.post(url, content=body, headers=headers)
        return len(response.content)

    return send, client.aclose


MAKERS = {"dpserve": make_dpserve, "aiohttp": make_aiohttp, "pyreqwest": make_pyreqwest,
          "httpx": make_httpx}


async def drive(kind: str, url: str, body: bytes, stream: bool, concurrency: int,
                warmup_s: float, duration_s: float) -> dict:
    send, close = await MAKERS[kind](url, body, stream)
    loop = asyncio.get_running_loop()
    start = loop.time()
    record_at = start + warmup_s
    stop_at = record_at + duration_s
    counts: dict = {"requests": 0, "errors": 0, "bytes": 0, "first_error": None}

    async def one_task() -> None:
        while (now := loop.time()) < stop_at:
            try:
                size = await send()
            except Exception as exc:
                counts["first_error"] = counts["first_error"] or repr(exc)[:300]
                if now >= record_at:
                    counts["errors"] += 1
                continue
            if now >= record_at:
                counts["requests"] += 1
                counts["bytes"] += size

    async def meter() -> tuple[float, float]:
        await asyncio.sleep(max(0.0, record_at - loop.time()))
        t0 = os.times()
        w0 = time.perf_counter()
        await asyncio.sleep(max(0.0, stop_at - loop.time()))
        t1 = os.times()
        return (time.perf_counter() - w0,
                (t1.user - t0.user) + (t1.system - t0.system))

    meter_task = asyncio.create_task(meter())
    await asyncio.gather(*(one_task() for _ in range(concurrency)))
    wall_s, cpu_s = await meter_task
    await close()
    return {"kind": kind, "stream": stream, **counts, "wall_s": wall_s, "cpu_s": cpu_s}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kind", choices=KINDS, required=True)
    p.add_argument("--url", required=True)
    p.add_argument("--body", required=True, help="the request body, as a string")
    p.add_argument("--stream", action="store_true")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--duration", type=float, default=3.0)
    args = p.parse_args()
    if BENCH_SITE.is_dir():
        # pyreqwest lives in the throwaway venv only; appended, so that venv's copies of
        # what .venv also has (uvloop) never shadow the project's.
        sys.path.append(str(BENCH_SITE))
    import uvloop

    result = uvloop.run(drive(args.kind, args.url, args.body.encode(), args.stream,
                              args.concurrency, args.warmup, args.duration))
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
