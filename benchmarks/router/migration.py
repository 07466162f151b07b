"""Stream migration on real vLLM CPU replicas: exactness, kill -9 under load, SIGSTOP.

One fleet (`common.fleet.fleet`): 2 replicas of the tiny model behind the router, composed in
this process as `dpserve serve` composes them, with `stream_idle_timeout_s` = --idle-s.

1. **Exactness.** For each k in --ks and each route (completions, chat): a greedy
   stream of --max-tokens tokens, uninterrupted (the reference); then the same stream
   pinned to r0 (r1 drained), r0's process group SIGKILLed after k chunks (r1 back in
   rotation just before). Printed: whether the migrated stream's token ids and text
   equal the reference's, the tokens replayed, and the gap at the seam (last chunk
   before the kill to the first after) beside the median gap between chunks. r0 is
   restarted by the supervisor before the next kill. Then (`+stop` rows) the same
   with a stop string of 12+ characters that begins a few chunks after k: text, ids
   and ending (finish and stop reason) against the same request uninterrupted. Then
   (`-json` rows) the same request not streamed, which the router asks of the engine
   as a stream and answers whole (`dpserve.router.forward.assembled`): r0 is killed
   once its engine counted k more generated tokens; the answer's text, ids, ending and
   usage against the uninterrupted answer.
2. **kill -9 under mixed load.** --workers clients (half streaming, half not) send
   greedy completions of 16 to 128 tokens for --load-s seconds; r0 is SIGKILLed a third
   of the way in. Counted per kind: completed, failed (target 0 and 0), migrated
   streams, and the latency a migration added (the seam's gap minus the median gap
   of the streams that did not move).
3. **SIGSTOP.** The same mixed load; r0 is stopped for --stop-s, then continued.
   Target: every request completes, no stream waits longer than --idle-s plus one
   re-prefill between two chunks, no non-streamed request longer than that plus its
   own generation (the longest gap, and the longest non-streamed request beside the
   median one, are printed beside that bound).

The router's CPU cost of tracking token ids is measured by
`overhead.py --migration-off-too`.

    python -m benchmarks.router.migration [--ks 1,8,64] [--max-tokens 200] [--load-s 30]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common.fleet import Fleet, fleet, wait_until
from dpserve.router.fleet.pool import ReplicaState
from dpserve.tinymodel import TINY_MODEL_NAME

ROUTES = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
RESTART_WITHIN_S = 180.0


@dataclass
class Streamed:
    ok: bool = False
    text: str = ""
    ids: list[int] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)
    """Each chunk's text."""
    end: tuple[str | None, str | None] = (None, None)
    """finish_reason and stop_reason."""
    arrivals: list[float] = field(default_factory=list)
    seams: list[dict[str, Any]] = field(default_factory=list)
    error: str = ""

    def gaps_ms(self) -> list[float]:
        return [(b - a) * 1000 for a, b in zip(self.arrivals, self.arrivals[1:], strict=False)]


def body(route: str, prompt: str, max_tokens: int, stream: bool = True,
         ids: bool = True) -> dict[str, Any]:
    out: dict[str, Any] = {"model": TINY_MODEL_NAME, "max_tokens": max_tokens,
                           "temperature": 0, "stream": stream, "ignore_eos": True}
    if ids:
        out["return_token_ids"] = True
    if route == "chat":
        return out | {"messages": [{"role": "user", "content": prompt}]}
    return out | {"prompt": prompt}


async def stream(client: httpx.AsyncClient, url: str, route: str, payload: dict[str, Any],
                 on_chunk: Any = None) -> Streamed:
    """One streamed answer as the client sees it; `on_chunk(n)` after the n-th chunk."""
    out = Streamed()
    async with client.stream("POST", url + ROUTES[route], json=payload) as r:
        if r.status_code != 200:
            out.error = f"HTTP {r.status_code}"
            return out
        n = 0
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                out.ok = out.ok or (line == "data: [DONE]" and not out.error)
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                out.error = chunk["error"]["message"]
                continue
            out.seams = chunk.get("dpserve", {}).get("migrations", out.seams)
            for c in chunk.get("choices", []):
                piece = (c.get("delta") or {}).get("content") if route == "chat" else c["text"]
                out.text += piece or ""
                out.pieces.append(piece or "")
                out.ids += c.get("token_ids") or []
                if c.get("finish_reason"):
                    out.end = (c["finish_reason"], c.get("stop_reason"))
            if chunk.get("choices"):
                out.arrivals.append(time.perf_counter())
                n += 1
                if on_chunk is not None:
                    on_chunk(n)
    return out


async def restarted(f: Fleet, replica: str, old_pid: int) -> None:
    await wait_until(lambda: f.supervisor.pids.get(replica) not in (None, old_pid)
                     and f.pool.get(replica).state is ReplicaState.READY,
                     RESTART_WITHIN_S, f"restart of {replica}")


async def exactness(f: Fleet, args: argparse.Namespace) -> list[str]:
    rows = []
    r1 = f.pool.get("r1")
    async with httpx.AsyncClient(timeout=120) as c:
        for route in args.routes:
            for k in args.ks:
                payload = body(route, f"Story {k}: once upon a time", args.max_tokens)
                reference = await stream(c, f.url, route, payload)
                f.pool.set_state(r1, ReplicaState.DRAINING, "benchmark: pin to r0")
                pid = f.supervisor.pids["r0"]
                killed_at: list[int] = []

                def kill(n: int, k: int = k, pid: int = pid,
                         killed_at: list[int] = killed_at) -> None:
                    if n == k:
                        f.pool.set_state(r1, ReplicaState.READY, "benchmark")
                        os.killpg(pid, signal.SIGKILL)
                        killed_at.append(n)

                moved = await stream(c, f.url, route, payload, kill)
                gaps = moved.gaps_ms()
                seam_gap = gaps[k - 1] if killed_at and len(gaps) >= k else float("nan")
                replayed = moved.seams[0]["replayed_tokens"] if moved.seams else None
                rows.append(f"{route:<12} {k:>5} {moved.ids == reference.ids!s:>10} "
                            f"{moved.text == reference.text!s:>9} {replayed!s:>9} "
                            f"{seam_gap:>12.1f} {statistics.median(gaps):>12.1f} "
                            f"{len(moved.seams):>6} {moved.error or '-'}")
                print(rows[-1], flush=True)
                await restarted(f, "r0", pid)
                if args.stops:
                    rows.append(await with_stop(f, c, route, k, payload, reference))
                    print(rows[-1], flush=True)
                rows.append(await not_streamed(f, c, route, k, payload))
                print(rows[-1], flush=True)
                if route == "chat":  # without a limit: to the end of the context
                    rows.append(await not_streamed(f, c, route, k, payload, limit=False))
                    print(rows[-1], flush=True)
    return rows


GENERATED = "vllm:generation_tokens_total"


async def generated(c: httpx.AsyncClient, url: str) -> float:
    """The engine's count of generated tokens (its Prometheus counter)."""
    text = (await c.get(url + "/metrics", timeout=5)).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(GENERATED + "{") or line.startswith(GENERATED + " "))


async def not_streamed(f: Fleet, c: httpx.AsyncClient, route: str, k: int,
                       payload: dict[str, Any], *, limit: bool = True) -> str:
    """The request not streamed, r0 killed once its engine generated k more tokens
    (polled every 5 ms): the whole answer against the uninterrupted one. Without
    `limit`, a chat without `max_tokens` (it runs to the end of the context)."""
    label = route + "-json" + ("" if limit else "-nolimit")
    # Longer than the streams: the kill must land before the whole answer is done.
    payload = payload | {"stream": False, "max_tokens": min(900, 4 * payload["max_tokens"])}
    if not limit:
        del payload["max_tokens"]
    reference = (await c.post(f.url + ROUTES[route], json=payload)).json()
    r0, r1 = f.pool.get("r0"), f.pool.get("r1")
    f.pool.set_state(r1, ReplicaState.DRAINING, "benchmark: pin to r0")
    pid = f.supervisor.pids["r0"]
    start = await generated(c, r0.url)

    async def kill() -> None:
        while await generated(c, r0.url) < start + k:
            await asyncio.sleep(0.005)
        f.pool.set_state(r1, ReplicaState.READY, "benchmark")
        os.killpg(pid, signal.SIGKILL)

    killer = asyncio.create_task(kill())
    r = await c.post(f.url + ROUTES[route], json=payload)
    killed = killer.done()
    killer.cancel()
    f.pool.set_state(r1, ReplicaState.READY, "benchmark")
    if not killed:
        return f"{label:<12} {k:>5} (the answer came before the kill)"
    await restarted(f, "r0", pid)
    got = r.json() if r.status_code == 200 else {}
    seams = got.get("dpserve", {}).get("migrations", [])

    def whole(answer: dict[str, Any]) -> tuple[Any, ...]:
        choice = (answer.get("choices") or [{}])[0]
        text = choice.get("message", {}).get("content") if route == "chat" else \
            choice.get("text")
        return (text, choice.get("token_ids"), choice.get("finish_reason"),
                answer.get("usage"))

    same = whole(got) == whole(reference)
    return (f"{label:<12} {k:>5} {same!s:>10} {same!s:>9} "
            f"{(seams[0]['replayed_tokens'] if seams else None)!s:>9} "
            f"{'':>12} {'':>12} {len(seams):>6} "
            f"{'-' if r.status_code == 200 else f'HTTP {r.status_code}'}")


def first_new(text: str, start: int) -> str | None:
    """The first text of 12 to 40 characters at or after `start` that does not occur
    before it (the tiny model repeats itself): a stop string with one place to stop."""
    for at in range(start, len(text)):
        for size in range(12, 41):
            piece = text[at:at + size]
            if len(piece) == size and text.find(piece) == at:
                return piece
    return None


async def with_stop(f: Fleet, c: httpx.AsyncClient, route: str, k: int,
                    payload: dict[str, Any], plain: Streamed) -> str:
    """The same kill, the stream given a stop string that begins a few chunks after k
    (vLLM holds back len - 1 >= 11 characters: the break lands before or inside it).
    Compared with the uninterrupted run of the same request: text and ending."""
    label = route + "+stop"
    stop = first_new(plain.text, len("".join(plain.pieces[:k + 4])))
    if stop is None:
        return f"{label:<12} {k:>5} (no unique stop string in the reference)"
    payload = payload | {"stop": [stop]}
    reference = await stream(c, f.url, route, payload)
    r1 = f.pool.get("r1")
    f.pool.set_state(r1, ReplicaState.DRAINING, "benchmark: pin to r0")
    pid = f.supervisor.pids["r0"]

    def kill(n: int) -> None:
        if n == k:
            f.pool.set_state(r1, ReplicaState.READY, "benchmark")
            os.killpg(pid, signal.SIGKILL)

    moved = await stream(c, f.url, route, payload, kill)
    await restarted(f, "r0", pid)
    same_end = moved.end == reference.end == ("stop", stop)
    return (f"{label:<12} {k:>5} {moved.ids == reference.ids!s:>10} "
            f"{moved.text == reference.text!s:>9}  same ending: {same_end!s:<5} "
            f"(stop string of {len(stop)} chars) {len(moved.seams):>6} {moved.error or '-'}")


@dataclass
class Load:
    done: dict[bool, int] = field(default_factory=lambda: {True: 0, False: 0})
    failed: dict[bool, list[str]] = field(default_factory=lambda: {True: [], False: []})
    migrated: list[Streamed] = field(default_factory=list)
    unmoved_gaps: list[float] = field(default_factory=list)
    longest_gap_ms: float = 0.0
    moved_whole: int = 0
    """Non-streamed requests continued on another replica mid-way."""
    whole_s: list[float] = field(default_factory=list)
    """Each non-streamed request's time to its answer."""


async def worker(c: httpx.AsyncClient, url: str, streaming: bool, until: float, load: Load,
                 rng: random.Random) -> None:
    while time.monotonic() < until:
        payload = body("completions", f"load {rng.random():.6f}", rng.randint(16, 128),
                       streaming, ids=streaming)
        try:
            if streaming:
                s = await stream(c, url, "completions", payload)
                ok, why = s.ok and not s.error, s.error
                if s.seams:
                    load.migrated.append(s)
                elif s.gaps_ms():
                    load.unmoved_gaps.append(statistics.median(s.gaps_ms()))
                load.longest_gap_ms = max([load.longest_gap_ms, *s.gaps_ms()])
            else:
                sent = time.perf_counter()
                r = await c.post(url + "/v1/completions", json=payload)
                load.whole_s.append(time.perf_counter() - sent)
                ok, why = r.status_code == 200, f"HTTP {r.status_code}"
                if ok and r.json().get("dpserve", {}).get("migrations"):
                    load.moved_whole += 1
        except httpx.HTTPError as exc:
            ok, why = False, type(exc).__name__
        if ok:
            load.done[streaming] += 1
        else:
            load.failed[streaming].append(why)


async def under_load(f: Fleet, args: argparse.Namespace, *, sig: signal.Signals,
                     streaming_only: bool) -> Load:
    load, rng = Load(), random.Random(7)
    until = time.monotonic() + args.load_s
    pid = f.supervisor.pids["r0"]
    async with httpx.AsyncClient(timeout=300) as c:
        tasks = [asyncio.create_task(worker(c, f.url, streaming_only or i % 2 == 0, until,
                                            load, rng)) for i in range(args.workers)]
        await asyncio.sleep(args.load_s / 3)  # the fault comes a third of the way in
        os.killpg(pid, sig)
        if sig is signal.SIGSTOP:
            await asyncio.sleep(args.stop_s)
            os.killpg(pid, signal.SIGCONT)
        await asyncio.gather(*tasks)
    if sig is signal.SIGKILL:
        await restarted(f, "r0", pid)
    return load


def report_load(title: str, load: Load, args: argparse.Namespace) -> None:
    print(f"\n{title}")
    for streaming in (True, False):
        kind = "streaming" if streaming else "non-streaming"
        failed = load.failed[streaming]
        if load.done[streaming] or failed:
            print(f"  {kind:<14} completed {load.done[streaming]:>4}  failed {len(failed):>3}"
                  + (f"  ({'; '.join(sorted(set(failed)))[:200]})" if failed else ""))
    base = statistics.median(load.unmoved_gaps) if load.unmoved_gaps else float("nan")
    added = [max(s.gaps_ms()) - base for s in load.migrated if s.gaps_ms()]
    if added:
        print(f"  migrated streams {len(load.migrated)}; latency added at the seam: median "
              f"{statistics.median(added):.0f} ms, max {max(added):.0f} ms "
              f"(median gap between chunks otherwise {base:.1f} ms)")
    else:
        print("  no stream migrated")
    print(f"  longest gap between two chunks of any stream: {load.longest_gap_ms:.0f} ms "
          f"(bound: idle timeout {args.idle_s * 1000:.0f} ms + one re-prefill)")
    if load.whole_s:
        print(f"  non-streamed requests continued mid-way on another replica: "
              f"{load.moved_whole}")
        print(f"  non-streamed requests: longest {max(load.whole_s) * 1000:.0f} ms, median "
              f"{statistics.median(load.whole_s) * 1000:.0f} ms (bound: idle timeout "
              f"{args.idle_s * 1000:.0f} ms + one re-prefill + the request's generation)")


async def run(args: argparse.Namespace) -> int:
    model = Path(args.model)
    with tempfile.TemporaryDirectory(prefix="dpserve-migration-bench-") as work:
        async with fleet(model, Path(work), 2, policy="round-robin",
                         stream_idle_timeout_s=args.idle_s) as f:
            if args.exactness:
                print(f"\n1. exactness: greedy streams of {args.max_tokens} tokens, r0 "
                      "killed after k chunks")
                print(f"{'route':<12} {'k':>5} {'same ids':>10} {'same text':>9} "
                      f"{'replayed':>9} {'seam gap ms':>12} {'median gap':>12} {'moves':>6} "
                      "error")
                await exactness(f, args)
            for trial in range(1, args.trials + 1):
                of = f", trial {trial} of {args.trials}" if args.trials > 1 else ""
                report_load(f"2. kill -9 of r0 under mixed load ({args.workers} clients, "
                            f"{args.load_s:g} s{of})",
                            await under_load(f, args, sig=signal.SIGKILL,
                                             streaming_only=False), args)
                report_load(f"3. SIGSTOP of r0 for {args.stop_s:g} s under the same load{of}",
                            await under_load(f, args, sig=signal.SIGSTOP,
                                             streaming_only=False), args)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="build/tiny-llama", help="a built tiny model")
    p.add_argument("--ks", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 64],
                   help="chunks before the kill, comma-separated")
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--load-s", type=float, default=30.0)
    p.add_argument("--stop-s", type=float, default=8.0)
    p.add_argument("--idle-s", type=float, default=2.0, help="the router's stream idle timeout")
    p.add_argument("--no-stops", dest="stops", action="store_false",
                   help="skip the exactness runs with a stop string")
    p.add_argument("--no-exactness", dest="exactness", action="store_false",
                   help="skip section 1 (the kills at k chunks)")
    p.add_argument("--routes", type=lambda s: s.split(","), default=list(ROUTES),
                   help="section 1's routes, comma-separated: completions, chat")
    p.add_argument("--trials", type=int, default=1,
                   help="times sections 2 and 3 run, one after the other")
    args = p.parse_args()
    if not Path(args.model, "config.json").is_file():
        p.error(f"--model {args.model}: no built model there (run `make model`)")
    if unknown := [r for r in args.routes if r not in ROUTES]:
        p.error(f"--routes: unknown {', '.join(unknown)} (known: {', '.join(ROUTES)})")
    if any(k < 1 or k >= args.max_tokens for k in args.ks):
        p.error("--ks: each k must be in 1..max-tokens - 1")
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
