"""The router's event loop while replicas flood it with KV events: the subscriber
(`dpserve.router.kv.subscriber`) applying every batch, and a probe that sleeps 1 ms
at a time and records how late it wakes (the loop's stalls). The baseline, measured
in the same run: the probe alone, no events.

    python -m benchmarks.routing.kv_feed [--replicas 4] [--seconds 5] [--rate 500]
                                         [--prompt-tokens 2048] [--block 16]

Each replica is a publisher process sending, `--rate` times a second, one batch that
stores a new `--prompt-tokens` prompt in `--block`-token blocks (one engine step's
worth of prefill: vLLM's batches are per step), in vLLM's wire format over a Unix
socket. Prints the batches applied per second, and the probe's p50, p99 and longest
lateness with and without the flood.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import msgspec
import zmq

from dpserve.router.kv.index import KVIndex
from dpserve.router.kv.sources import EventSource
from dpserve.router.kv.subscriber import Subscriber
from dpserve.sim.kv_events import KVEventBatch, stored


def publish(endpoint: str, seconds: float, rate: float, tokens: int, block: int,
            base: int) -> None:
    """A publisher process: `rate` batches a second for `seconds`, then stops."""
    sock = zmq.Context.instance().socket(zmq.PUB)
    sock.bind(endpoint)
    time.sleep(0.5)  # the subscriber connects
    encoder = msgspec.msgpack.Encoder()
    seq, start = 0, time.monotonic()
    while (now := time.monotonic()) - start < seconds:
        ids = [base + seq * tokens + i for i in range(tokens)]
        hashes = [base + seq * 10_000 + i for i in range(tokens // block)]
        event = stored(hashes, None, ids, block)
        payload = encoder.encode(KVEventBatch(ts=time.time(), events=[event],
                                              data_parallel_rank=0))
        sock.send_multipart([b"kv", seq.to_bytes(8, "big"), payload])
        seq += 1
        time.sleep(max(0.0, start + seq / rate - now))
    sock.close(linger=1000)


async def probe(seconds: float) -> list[float]:
    late = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        before = time.monotonic()
        await asyncio.sleep(0.001)
        late.append(time.monotonic() - before - 0.001)
    return late


def describe(name: str, late: Sequence[float]) -> str:
    ordered = sorted(late)
    p99 = ordered[int(len(ordered) * 0.99)]
    return (f"{name:<10} p50 {statistics.median(ordered) * 1e3:6.2f} ms   "
            f"p99 {p99 * 1e3:6.2f} ms   longest {ordered[-1] * 1e3:6.2f} ms")


async def run(args: argparse.Namespace) -> None:
    baseline = await probe(min(args.seconds, 3.0))
    index = KVIndex()
    subscriber = Subscriber(index)
    with tempfile.TemporaryDirectory(prefix="kvfeed-") as tmp:
        ctx = multiprocessing.get_context("spawn")
        procs = []
        for r in range(args.replicas):
            endpoint = f"ipc://{Path(tmp)}/r{r}"
            procs.append(ctx.Process(target=publish, args=(
                endpoint, args.seconds, args.rate, args.prompt_tokens, args.block,
                r * 10**9), daemon=True))
            procs[-1].start()
            subscriber.start(f"r{r}", EventSource(endpoint, None, "kv"))
        await asyncio.sleep(0.5)
        started = time.monotonic()
        flooded = await probe(args.seconds - 0.5)
        elapsed = time.monotonic() - started
        for p in procs:
            p.join(timeout=10)
        stats = subscriber.stats()
        await subscriber.aclose()
    batches = sum(s.batches for s in stats.values())
    print(f"{args.replicas} replicas x {args.rate:g} batches/s of "
          f"{args.prompt_tokens} tokens in {args.block}-token blocks: "
          f"{batches / elapsed:.0f} batches/s applied, "
          f"resyncs {sum(s.resyncs for s in stats.values())}")
    print(describe("idle", baseline))
    print(describe("flooded", flooded))


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--rate", type=float, default=500.0, help="batches/s per replica")
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--block", type=int, default=16)
    asyncio.run(run(p.parse_args(argv)))


if __name__ == "__main__":
    main()
