"""dpserve's own Python per forwarded request, without sockets or a server in front.

```sh
.venv/bin/python -m benchmarks.router.proxy_python [--requests 20000] [--concurrency 32]
    [--stream] [--migration-off] [--rounds 5] [--profile] [--ref REF]
```

`overhead.py` measures the whole router process: its numbers move by ±20%
between runs on a shared 2-core machine, more than most single changes to the
data plane's code save. This benchmark isolates that code: the router's ASGI app
(`build_app`, the default prefix-affinity policy, two ready replicas, metrics,
migration tracking on) is called in-process with canned requests, and its
upstream client is replaced by one that answers each request at once from memory
with a replica's completion (or, `--stream`, a 16-event SSE stream in one chunk,
with token ids as vLLM sends them to a router that tracks the stream).
No socket, no uvicorn, no kernel: what is left is dispatch, policy, request
parsing, headers, metrics and the relay, whose CPU time per request
(`time.process_time`) repeats within a few percent.

`--ref REF` runs the same against dpserve as committed at REF (in a subprocess,
from a `git archive` of it), for a before/after in one command: each round runs
both, back to back, and the median of the per-round ratios is printed (the
machine's speed drifts between rounds by more than most changes save; the ratio
of two runs a second apart drifts less). `--profile` adds
a cProfile of one round, top functions by own time.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import inspect
import io
import json
import pstats
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

from benchmarks.common.tools import REPO

MODEL = "fixed-model"


def canned(stream: bool) -> tuple[list[tuple[bytes, bytes]], bytes]:
    from benchmarks.router.fixed_upstream import DONE_EVENT, build_bodies

    bodies = build_bodies(MODEL, 16)
    if stream:
        # As vLLM answers the router, which asks for `return_token_ids` on a stream it
        # tracks: the prompt's ids on the first event, each event its token's id.
        events = [chunk.replace(b'"token_ids":null', b'"token_ids":[%d]' % (1000 + i))
                  for i, chunk in enumerate(bodies.chat_chunks)]
        events[0] = events[0].replace(b'"prompt_token_ids":null',
                                      b'"prompt_token_ids":[1,15043,3186,29991]')
        body = b"".join(events) + DONE_EVENT
        return [(b"content-type", b"text/event-stream; charset=utf-8")], body
    return [(b"content-type", b"application/json"),
            (b"content-length", str(len(bodies.completion)).encode())], bodies.completion


class CannedUpstream:
    """Stands in for `UpstreamPool` (`Router(upstream=...)`): every request is
    answered at once, from memory, with `UpstreamResponse.canned`."""

    def __init__(self, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        self._answer = _canned_factory(headers, body)
        self.requests = 0

    def open(self, origin: Any, target: bytes, headers: bytes, body: bytes,
             **_: Any) -> Any:
        self.requests += 1
        return _Answer(self._answer())

    async def request(self, origin: Any, head: bytes, body: bytes, **_: Any) -> Any:
        """The client's API before `open` (a `--ref` older than the seam)."""
        self.requests += 1
        return self._answer()

    def close(self) -> None:
        pass


def _canned_factory(headers: list[tuple[bytes, bytes]], body: bytes) -> Any:
    from dpserve.router.upstream.client import UpstreamResponse

    if hasattr(UpstreamResponse, "canned"):
        return lambda: UpstreamResponse.canned(200, headers, body)

    def made() -> Any:  # a --ref before `canned`: set as it would
        resp = UpstreamResponse(None)
        resp.status, resp.raw_headers = 200, list(headers)
        resp.keep_alive = resp.complete = True
        resp.chunks = deque([body])
        resp._buffered = len(body)
        return resp

    return made


class _Answer:
    """`async with`: one canned response, released on the way out."""

    __slots__ = ("_resp",)

    def __init__(self, resp: Any) -> None:
        self._resp = resp

    async def __aenter__(self) -> Any:
        return self._resp

    async def __aexit__(self, *exc: object) -> None:
        self._resp.release()


async def drive(requests: int, concurrency: int, stream: bool, profile: bool,
                migration: bool = True) -> dict:
    from dpserve.config import RouterConfig
    from dpserve.router.fleet.pool import Replica, ReplicaPool, ReplicaState
    from dpserve.router.http.app import Router, build_app

    pool = ReplicaPool([Replica(id=f"r{i}", url=f"http://127.0.0.1:{9000 + i}",
                                state=ReplicaState.READY, models=frozenset({MODEL}))
                        for i in range(2)])
    config = RouterConfig() if migration else RouterConfig(migration_limit=0)
    headers, body = canned(stream)
    upstream = CannedUpstream(headers, body)
    if "upstream" in inspect.signature(Router).parameters:
        router = Router(pool, config, upstream=upstream)
        app = build_app(router)
    else:  # a --ref before Router(upstream=...): its data plane's client, swapped
        router = Router(pool, config)
        app = build_app(router)
        for endpoint in app._forwarded.values():
            endpoint._upstream = upstream
            endpoint._migrator._upstream = upstream
    path = "/v1/chat/completions" if stream else "/v1/completions"
    payload = (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Say hi"}],
                           "max_tokens": 16, "stream": True}) if stream else
               json.dumps({"model": MODEL, "prompt": "Say hello", "max_tokens": 16})).encode()
    scope_headers = [(b"host", b"127.0.0.1:8000"), (b"content-type", b"application/json"),
                     (b"content-length", str(len(payload)).encode())]
    statuses: dict[int, int] = {}
    sent = [0]

    async def one() -> None:
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
                 "query_string": b"", "root_path": "", "headers": scope_headers,
                 "client": ("127.0.0.1", 40000), "server": ("127.0.0.1", 8000)}
        given = False

        async def receive() -> dict:
            nonlocal given
            if not given:
                given = True
                return {"type": "http.request", "body": payload, "more_body": False}
            await asyncio.Event().wait()  # the client stays: never a disconnect
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            if message["type"] == "http.response.start":
                statuses[message["status"]] = statuses.get(message["status"], 0) + 1
            else:
                sent[0] += len(message.get("body", b""))

        await app(scope, receive, send)

    async def worker(n: int) -> None:
        for _ in range(n):
            await one()

    for _ in range(200):  # warm-up: caches, metric children
        await one()
    statuses.clear()
    profiler = cProfile.Profile() if profile else None
    per = [requests // concurrency + (i < requests % concurrency) for i in range(concurrency)]
    t0 = time.process_time()
    if profiler:
        profiler.enable()
    await asyncio.gather(*(worker(n) for n in per))
    if profiler:
        profiler.disable()
    cpu = time.process_time() - t0
    out: dict[str, Any] = {"requests": requests, "cpu_us": cpu / requests * 1e6,
                           "statuses": statuses, "bytes": sent[0]}
    if profiler:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
        out["profile"] = text.getvalue()
    return out


def run_here(args: argparse.Namespace) -> dict:
    import uvloop

    return uvloop.run(drive(args.requests, args.concurrency, args.stream, args.profile,
                            not args.migration_off))


def run_ref(ref: str, args: argparse.Namespace, work: Path) -> dict:
    """One round against dpserve as committed at `ref` (exported once under `work`)."""
    src = work / "ref"
    if not src.exists():
        archive = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", ref,
                                  "dpserve"], capture_output=True, check=True)
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            tar.extractall(src, filter="data")
    return run_once(args, src, f"the run at {ref}")


def run_once(args: argparse.Namespace, src: Path, what: str) -> dict:
    """One round in a fresh process, with dpserve imported from `src` (and the benchmarks
    from the checkout: an exported ref holds only dpserve)."""
    argv = [sys.executable, "-m", "benchmarks.router.proxy_python", "--once", "--requests",
            str(args.requests), "--concurrency", str(args.concurrency)]
    argv += ["--stream"] * args.stream + ["--migration-off"] * args.migration_off
    done = subprocess.run(argv, capture_output=True, text=True, cwd=src, check=False,
                          env={"PYTHONPATH": f"{src}:{REPO}", "PATH": "/usr/bin:/bin"})
    if done.returncode != 0:
        raise SystemExit(f"{what} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=20000, help="recorded requests per round")
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight")
    p.add_argument("--stream", action="store_true", help="streamed chat completions")
    p.add_argument("--rounds", type=int, default=5, help="rounds (median reported)")
    p.add_argument("--profile", action="store_true", help="cProfile one round of the tree")
    p.add_argument("--ref", help="also run dpserve as committed at REF, interleaved")
    p.add_argument("--migration-off", action="store_true",
                   help="--migration-limit 0: streams are relayed without tracking their ids")
    p.add_argument("--once", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.requests < 1 or args.concurrency < 1 or args.rounds < 1:
        p.error("--requests, --concurrency and --rounds must be at least 1")
    if args.once:
        print(json.dumps(run_here(args)))
        return 0
    kind = "stream (16 events, one chunk)" if args.stream else "completions"
    print(f"{kind}: {args.requests} requests per round, {args.concurrency} in flight, "
          f"{args.rounds} rounds", flush=True)
    tree: list[float] = []
    ref: list[float] = []
    ratios: list[float] = []
    with tempfile.TemporaryDirectory(prefix="dpserve-proxy-") as tmp:
        for i in range(args.rounds):
            got = run_once(args, REPO, "the run of the working tree")
            if set(got["statuses"]) != {"200"}:
                raise SystemExit(f"the tree answered {got['statuses']}, not only 200")
            tree.append(got["cpu_us"])
            line = f"round {i + 1}: tree {got['cpu_us']:.1f} us/req"
            if args.ref:
                other = run_ref(args.ref, args, Path(tmp))
                ref.append(other["cpu_us"])
                ratios.append(got["cpu_us"] / other["cpu_us"])
                line += f", {args.ref} {other['cpu_us']:.1f} us/req ({ratios[-1]:.2f}x)"
            print(line, flush=True)
    summary = f"median: tree {statistics.median(tree):.1f} us/req"
    if ref:
        summary += (f", {args.ref} {statistics.median(ref):.1f} us/req; tree/ref per round: "
                    f"median {statistics.median(ratios):.3f}x (range {min(ratios):.2f}-"
                    f"{max(ratios):.2f})")
    print(summary)
    if args.profile:
        args.requests = min(args.requests, 20000)
        print(run_here(args)["profile"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
