"""`python -m loadtest run --base-url URL --model NAME [--num-prompts N] [--max-concurrency C]`."""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp


@dataclass
class Result:
    ok: bool
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    output_tokens: int = 0
    error: str = ""

    @property
    def tpot_s(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


async def one_request(session: aiohttp.ClientSession, url: str, body: dict) -> Result:
    start = time.perf_counter()
    ttft = 0.0
    tokens = 0
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                return Result(ok=False, error=f"HTTP {resp.status}")
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return Result(ok=False, error=event["error"].get("message", "stream error"))
                if event.get("choices") and event["choices"][0].get("text") and not ttft:
                    ttft = time.perf_counter() - start
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
    except (aiohttp.ClientError, TimeoutError) as exc:
        return Result(ok=False, error=type(exc).__name__)
    return Result(ok=True, ttft_s=ttft, e2e_s=time.perf_counter() - start, output_tokens=tokens)


async def run(args: argparse.Namespace) -> dict:
    url = args.base_url.rstrip("/") + "/v1/completions"
    body = {"model": args.model, "prompt": args.prompt, "max_tokens": args.max_tokens,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(args.num_prompts):
        queue.put_nowait(i)
    results: list[Result] = []
    timeout = aiohttp.ClientTimeout(total=args.request_timeout_s)

    async with aiohttp.ClientSession(timeout=timeout) as session:
        async def worker() -> None:
            while not queue.empty():
                queue.get_nowait()
                results.append(await one_request(session, url, body))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.max_concurrency)))
        duration = time.perf_counter() - start
    return summarize(results, duration)


def summarize(results: list[Result], duration: float) -> dict:
    ok = [r for r in results if r.ok]

    def stats(values: list[float]) -> dict[str, float]:
        if not values:
            return {}
        q = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else (
            values * 99)
        return {"mean_ms": 1e3 * statistics.fmean(values), "median_ms": 1e3 * q[49],
                "p99_ms": 1e3 * q[98]}

    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok}),
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_token_throughput": sum(r.output_tokens for r in ok) / duration if duration else 0,
        "ttft": stats([r.ttft_s for r in ok]),
        "tpot": stats([t for r in ok if (t := r.tpot_s) is not None]),
        "e2el": stats([r.e2e_s for r in ok]),
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="closed-loop load with streaming completions")
    r.add_argument("--base-url", required=True)
    r.add_argument("--model", required=True)
    r.add_argument("--num-prompts", type=int, default=32)
    r.add_argument("--max-concurrency", type=int, default=4)
    r.add_argument("--max-tokens", type=int, default=32)
    r.add_argument("--prompt", default="Once upon a time")
    r.add_argument("--request-timeout-s", type=float, default=600.0)
    args = p.parse_args(argv)
    if args.num_prompts < 1 or args.max_concurrency < 1:
        p.error("--num-prompts and --max-concurrency must be >= 1")
    try:
        summary = asyncio.run(run(args))
    except aiohttp.ClientConnectorError as exc:
        print(f"loadtest: cannot reach {args.base_url}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(summary, indent=2))
    return 0 if summary["failed"] == 0 else 1
